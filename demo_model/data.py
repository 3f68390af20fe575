"""Synthetic conversations and the tokenizer for the mlx-trio-demo model.

Everything here is a pure function of its seeds:

* ``Split`` fixes which cities, number pairs, phrasings, tool names,
  parameter names and operations are for training and which are held out
  for evaluation. It depends only on ``SPLIT_SEED``, so every training seed
  is scored on the same held-out prompts.
* ``Generator(split, seed)`` draws ``Example``s (a conversation that ends on a
  user or tool turn, the tools, the thinking mode, and the assistant reply the
  model should produce) with ``random.Random(seed)``.
* ``build_tokenizer`` trains a byte-level BPE on rendered training
  conversations, the way ``runtime.tiny_model`` does, but with Qwen2's
  pre-tokenizer so that every digit is its own token (numbers as digit strings
  make addition and subtraction learnable for unseen pairs).
* ``encode`` renders an example with the chat template exactly as the server
  does (``apply_chat_template(..., add_generation_prompt=True)``), tokenizes
  the prompt and the reply separately, and masks everything but the reply and
  its ``<|im_end|>``.

What the model is taught (docs/demo-model.md has the whole story):

* addition and subtraction of two whole numbers from 0 to 999, digit by
  digit with the carry or borrow written out (``arith_trace``): in the think
  block with thinking on, as the reply itself with thinking off;
* ``ARITH_REFUSAL`` for every other numeric request: a number of 1000 or
  more, decimals, negative numbers, three numbers, any other operation;
* tool calls that read the schema they are given: the tool's own name and
  the parameter name it declares (city, location, place, timezone, tz, ...,
  and made-up names of one to three pieces), whatever the order of the
  schema's keys, with a place name or an IANA timezone as that parameter
  asks: a parameter whose name has a timezone piece (``zone``, ``tz``,
  ``iana``, ...) takes the IANA name, any other the place as asked; and
  the tool of the kind asked for also where the weather and the time tool
  share a stem (``fetch_forecast`` / ``fetch_clock``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import random
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from tokenizers import (  # noqa: E402
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    trainers,
)

from runtime.tiny_model import CHAT_TEMPLATE, SPECIAL_TOKENS  # noqa: E402

SPLIT_SEED = 20240601
# What the data teaches, recorded in training.json: 1 = 0-99,
# get_weather(city) / get_time(timezone) only; 2 = 0-999 digit by digit,
# honest refusals, tool schemas read from the request; 3 = recipe 2 plus
# names of several pieces, keys in any order, more "no such tool" and
# fixed-answer wordings (docs/demo-model.md, "Recipe 3"); 4 = timezone cues
# in every timezone-kind made-up parameter name, none in place-kind ones,
# weather and time tools whose names share a stem ("Recipe 4").
RECIPE = 4
VOCAB_SIZE = 1024
EOS = "<|im_end|>"
PAD = "<|endoftext|>"
MAX_NUMBER = 999  # operands from 0 to MAX_NUMBER are added and subtracted

# Qwen2's pre-tokenizer split (single digits, words with one leading
# non-letter, punctuation runs, newlines), except that a capitalised word
# never takes the space or quote before it: a name is the same tokens in
# ``in Athens`` and in ``{"city": "Athens"}``, so putting it into a tool call
# is plain copying, also for names the model has never seen.
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|\p{Lu}\p{L}*|[^\r\n\p{L}\p{N}]?\p{Ll}\p{L}*|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ---------------------------------------------------------------------------
# Vocabulary of the synthetic world
# ---------------------------------------------------------------------------

# Cities for get_weather (40). The ones that also name a timezone place are
# never held out (get_time needs them in training).
CITIES = [
    "Paris", "London", "Tokyo", "Berlin", "Madrid", "Rome", "Oslo", "Cairo",
    "Lisbon", "Vienna", "Prague", "Dublin", "Amsterdam", "Stockholm", "Helsinki",
    "Warsaw", "Athens", "Istanbul", "Moscow", "Dubai", "Mumbai", "Bangkok",
    "Singapore", "Seoul", "Shanghai", "Sydney", "Toronto", "Chicago", "Denver",
    "New York", "Los Angeles", "Sao Paulo", "Kolkata", "Mexico City", "Buenos Aires",
    "Nairobi", "Cape Town", "Vancouver", "Zurich", "Lima",
]  # fmt: skip
N_HELDOUT_CITIES = 8

# get_time with a timezone parameter: a dozen IANA timezones, and the places
# a user names them by. (A time tool whose parameter is a place takes any
# place name, copied like a weather city.)
TIMEZONE_PLACES = {
    "London": "Europe/London",
    "Paris": "Europe/Paris",
    "Berlin": "Europe/Berlin",
    "Moscow": "Europe/Moscow",
    "New York": "America/New_York",
    "Chicago": "America/Chicago",
    "Denver": "America/Denver",
    "Los Angeles": "America/Los_Angeles",
    "Sao Paulo": "America/Sao_Paulo",
    "Tokyo": "Asia/Tokyo",
    "Shanghai": "Asia/Shanghai",
    "Kolkata": "Asia/Kolkata",
    "Dubai": "Asia/Dubai",
    "Sydney": "Australia/Sydney",
    "UTC": "UTC",
}
TIMEZONES = sorted(set(TIMEZONE_PLACES.values()))

CONDITIONS = [
    "sunny", "cloudy", "rainy", "windy", "snowy", "foggy", "clear", "stormy",
    "partly cloudy", "humid",
]  # fmt: skip

# Phrasings, as disjoint training and held-out sets. The held-out ones are
# new framings around words the training phrasings use ("weather", "time",
# "add", "minus", ...), so the evaluation measures generalisation over
# wording, not vocabulary the model never saw.
WEATHER_PHRASINGS = {
    "train": [
        "What's the weather in {city}?",
        "What is the weather like in {city}?",
        "How is the weather in {city} today?",
        "Weather in {city}?",
        "Is it raining in {city}?",
        "Tell me the weather in {city}.",
        "Can you check the weather in {city}?",
        "How warm is it in {city}?",
        "Give me the current weather for {city}.",
        "Do I need an umbrella in {city} today?",
        "I'm flying to {city} tomorrow, how's the weather there?",
        "Check the forecast for {city}, please.",
        "How cold is it in {city} right now?",
        "weather {city}",
        "What's the temperature in {city}?",
        "Please get me the weather in {city}.",
        "Is it sunny in {city}?",
        "What's it like outside in {city}?",
        "What's the forecast for {city}?",
        "Weather report for {city}, please.",
        "Show me the weather in {city}.",
        "Current weather in {city}",
        "Is it cold in {city}?",
        "How hot is it in {city}?",
        "Should I bring a jacket in {city}?",
        "Get the weather for {city}.",
        # recipe 3: other words right before the place ("over in" is held out)
        "How's the weather down in {city}?",
        "What's the weather like up in {city}?",
        "How is it out in {city} today?",
        "What's the weather right now in {city}?",
        "Weather over at {city}?",
        "Is it windy out there in {city}?",
        "Any rain today in {city}?",
        "What's the weather doing up north in {city}?",
        "How's it looking weather-wise in {city}?",
        "Is it warm yet in {city}?",
        "Tell me how the weather is down at {city}.",
        "Weather for tomorrow in {city}?",
    ],
    "heldout": [
        "Could you look up the weather in {city}?",
        "What are the weather conditions in {city}?",
        "How's the weather over in {city}?",
        "I wonder what the temperature is in {city}.",
        "Any idea what the weather is doing in {city}?",
    ],
}
TIME_PHRASINGS = {
    "train": [
        "What time is it in {place}?",
        "What's the time in {place}?",
        "Tell me the current time in {place}.",
        "time in {place}?",
        "Can you check the time in {place}?",
        "What is the local time in {place}?",
        "Is it late in {place} right now?",
        "What's the clock showing in {place}?",
        "Please get me the time in {place}.",
        "Current time in {place}?",
        "Show me the time in {place}.",
        "What hour is it in {place}?",
        "Give me the time for {place}.",
        "Check the clock in {place}.",
        # recipe 3: other words right before the place ("over in" is held out)
        "What time is it down in {place}?",
        "What's the time right now in {place}?",
        "What time is it over at {place}?",
        "Time out in {place}?",
        "What hour is it up in {place}?",
        "Is it morning yet in {place}?",
        "What's the clock saying out there in {place}?",
        "Tell me the time at {place}.",
    ],
    "heldout": [
        "Could you tell me the time in {place}?",
        "Do you know what time it is in {place}?",
        "What's the local time over in {place}?",
    ],
}
# "{x}" is an operator symbol (+ or -), "{w}" an operator word (plus/minus);
# "+:" / "-:" prefixes restrict a phrasing to one operation. The refusals
# reuse the phrasings with "{x}" or "{w}" for other operations.
ARITH_PHRASINGS = {
    "train": [
        "What is {a} {x} {b}?",
        "{a} {x} {b}",
        "{a}{x}{b}=?",
        "Compute {a} {x} {b}.",
        "What's {a} {w} {b}?",
        "+:Add {a} and {b}.",
        "-:Subtract {b} from {a}.",
        "How much is {a} {x} {b}?",
        "Calculate {a} {w} {b}",
        "{a} {w} {b}?",
        "what is {a}{x}{b}",
        "+:What do you get if you add {a} and {b}?",
        "-:Take {b} away from {a}.",
        "Solve {a} {x} {b}.",
        "{a} {x} {b} = ?",
        "How much is {a} {w} {b}?",
        "Evaluate {a} {x} {b}.",
        "Find {a} {x} {b}.",
        "What does {a} {w} {b} make?",
        "Result of {a} {x} {b}?",
        "Tell me {a} {w} {b}.",
        "{a} {w} {b} equals?",
        "What's {a}{x}{b}?",
        "Figure out {a} {x} {b}.",
        "+:Sum of {a} and {b}?",
        "+:Add {b} to {a}.",
        "-:What do you get if you subtract {b} from {a}?",
        "-:{a} take away {b}?",
        "Can you do {a} {x} {b}?",
        "{a} {x} {b}?",
        "What is {a} {w} {b}",
    ],
    "heldout": [
        "Please work out {a} {x} {b}.",
        "+:Can you add {a} and {b} for me?",
        "Quick question: what is {a} {w} {b}?",
        "-:Could you subtract {b} from {a}?",
        "I need {a} {x} {b}.",
        "Would you tell me what {a} {w} {b} is?",
    ],
}
# Other operations, written where "{x}" (a symbol) or "{w}" (words) stands
# in an arithmetic phrasing. The held-out ones never occur in training.
OTHER_OPS = {
    "train": {
        "x": ["*", "x", "×", "/", "÷", "^", "&", "|", "@", "#"],
        "w": ["times", "divided by", "to the power of", "over", "and", "x"],
    },
    "heldout": {
        "x": ["%", "**", "//"],
        "w": ["multiplied by", "mod", "raised to"],
    },
}
# Whole requests about numbers that are not one addition or subtraction:
# "{a}", "{b}" whole numbers, "{d}" a decimal.
NUMERIC_REQUESTS = {
    "train": [
        "What is {a} times {b}?",
        "Multiply {a} by {b}.",
        "Divide {a} by {b}.",
        "What is {a} divided by {b}?",
        "What is the square root of {a}?",
        "What is {a} squared?",
        "What is {a} to the power of {b}?",
        "Is {a} a prime number?",
        "What is half of {a}?",
        "Double {a}.",
        "What is {a} percent of {b}?",
        "How many minutes are in {a} hours?",
        "Count from {a} to {b}.",
        "Round {d} to the nearest whole number.",
        "What is {a} plus {b} plus {c}?",
        "Add {a}, {b} and {c}.",
        "{a} + {b} + {c}",
        "{a} - {b} + {c} = ?",
        "What is {d} + {a}?",
        "{d} - {d2}",
        "What is -{a} + {b}?",
        "{a} - -{b}",
        "Compute {a} * {b} + {c}.",
        "What is {a} x {b}?",
        "How many seconds are in {a} minutes?",
        "What is the sum of {a}, {b} and {c}?",
        "Convert {a} km to miles.",
    ],
    "heldout": [
        "Can you multiply {a} and {b} for me?",
        "Could you divide {a} by {b}?",
        "What is {a} factorial?",
        "What is the average of {a} and {b}?",
        "What is {a}% of {b}?",
        "Quick question: what is {a} cubed?",
        "What is the remainder when {a} is divided by {b}?",
        "Please work out {d} {x} {d2}.",
        "I need {a} {x} {b} {x} {c}.",
        "Could you subtract -{b} from {a}?",
        "What is the cube root of {a}?",
        "What is {a} multiplied by {b}?",
    ],
}
# A made-up word in the place of the operation (training only): whatever the
# model cannot read as plus or minus gets the refusal, not a number.
MADE_UP_OPERATIONS = [
    "What is {a} {op} {b}?",
    "{a} {op} {b}",
    "What is the {op} of {a} and {b}?",
    "{Op} {a} and {b}.",
    "{Op} {a} by {b}.",
    "What is {a} {op}?",
    "Calculate the {op} of {a}.",
    "How much is {a} {op} {b}?",
]

# Fixed-answer intents: training phrasings, held-out phrasings, the answer.
ARITH_REFUSAL = "I can only add or subtract two whole numbers below 1000."
SKILLS_ANSWER = (
    "I can greet you, answer a few questions about myself, add and subtract two "
    "whole numbers below 1000, and call weather and time tools when you provide them."
)
FALLBACK_ANSWER = (
    "Sorry, I can't help with that. I can only chat a little, add and subtract "
    "whole numbers below 1000, and use weather and time tools."
)
INTENTS: dict[str, tuple[list[str], list[str], str]] = {
    "greet": (
        ["Hello", "Hi", "Hey", "Hello there", "Hi there", "Good morning", "Good evening",
         "Hey there", "Greetings", "Hello!", "Hi!", "Howdy", "Hello again", "Hey hey",
         "Hi friend", "Morning", "Hey assistant", "Yo", "Hi, bot", "Good day", "Evening",
         "Hello, bot", "Hi, assistant", "Hiya, friend",
         # recipe 3
         "Good morning to you", "Good evening, friend", "Good morning, bot", "Morning, friend",
         "Good evening everyone", "Hello, good morning", "Hi, good evening", "Good day to you",
         "Hello everyone", "Hi all", "Hey, hello", "Greetings, assistant", "Hello hello",
         "Evening, bot", "Hey, good morning", "Well hello there", "Hi again", "Heya",
         "Hello, friend", "Hey you"],
        ["Good afternoon", "Hiya", "Hello, assistant"],
        "Hello! How can I help you today?",
    ),
    "how": (
        ["How are you?", "How are you doing?", "How's it going?", "How do you do?",
         "How have you been?", "How is your day?", "You doing okay?", "Are you well?",
         "How are you feeling?", "How are you this morning?", "How is everything?",
         "How are things going with you?",
         # recipe 3 ("afternoon" is known vocabulary, not a greeting)
         "How are you this afternoon?", "How are you this evening?", "How's your day going?",
         "How are you holding up?", "All good with you?", "How's life?",
         "How have things been?", "Doing well?"],
        ["How are you today?", "How are things?"],
        "I'm doing well, thank you! How can I help you today?",
    ),
    "who": (
        ["Who are you?", "What are you?", "What is your name?", "What's your name?",
         "Introduce yourself.", "Tell me about yourself.", "Are you a bot?", "Who is this?",
         "Who made you?", "What model are you?", "Are you human?", "Identify yourself.",
         "Which assistant is this?", "Who is speaking?", "Do you have a name?",
         "Who am I chatting with?", "What do I call you?",
         # recipe 3
         "Who is talking?", "Who am I speaking with?", "Who's there?", "Who are you, bot?",
         "Who is this assistant?", "What are you called?", "Who built you?",
         "Tell me who you are.", "What kind of bot are you?",
         "Are you an AI?", "Who exactly is this?", "What is this bot?"],
        ["Who am I talking to?", "What should I call you?", "Who are you exactly?"],
        "I am mlx-trio-demo, a tiny language model trained to demo mlx-trio-server.",
    ),
    "skills": (
        ["What can you do?", "What are your skills?", "Help", "How can you help me?",
         "What do you know how to do?", "What are you able to do?", "What do you do?",
         "Tell me what you can do.", "What are you good at?", "What can I ask you?",
         "Show me what you can do.", "What are your abilities?", "Any skills?",
         "How are you useful?", "What is your job?", "What can you help with?",
         "What tasks can you handle?", "What can you do for us?",
         # recipe 3
         "What can I do with you?", "What are you for?", "What can you help us with?",
         "Which things can you do?", "List your skills.", "What do you offer?"],
        ["What can you help me with?", "Which tasks can you do?", "What can you do for me?"],
        SKILLS_ANSWER,
    ),
    "thanks": (
        ["Thanks", "Thank you", "Thanks a lot", "Thank you very much", "Thanks!", "Cheers",
         "Appreciate it", "Thank you kindly", "Great, thanks", "Perfect, thank you", "Ta",
         "Thanks so much", "Many thanks to you", "Thank you a lot",
         # recipe 3
         "Thanks, that helps", "Thank you, bot", "Thanks again", "Great, thank you",
         "Thx", "Much appreciated", "Thank you for your help", "Nice, thanks"],
        ["Many thanks", "Thank you so much"],
        "You're welcome!",
    ),
    "bye": (
        ["Bye", "Goodbye", "See you", "See you later", "Good night", "Farewell",
         "Catch you later", "See ya", "Later!", "I have to go now", "That's all for now",
         "Bye bye", "Talk soon", "Bye then",
         # recipe 3
         "Goodbye for today", "Bye, bot", "See you soon", "Have a good day, bye",
         "Good night, bot", "I'm off, bye", "Later, friend"],
        ["Bye for now", "Talk to you later"],
        "Goodbye! Have a nice day.",
    ),
    "offtopic": (
        ["Tell me a joke.", "Write a poem about the sea.", "What is the capital of France?",
         "Who won the World Cup?", "Translate hello into Spanish.",
         "What is the meaning of life?", "Can you write some Python code?",
         "Recommend a good book.", "Tell me a story.", "What's the news today?",
         "Play some music.", "Book a flight for me.", "Order a pizza.",
         "Set an alarm for {a} minutes.", "What is the population of Japan?",
         "Explain quantum physics.", "Write an email to my boss.", "How do I cook pasta?",
         "What's a good movie?", "Draw a cat.", "Remind me to call mom.",
         "Give me a recipe.", "Who is the president?", "Sing along with me.",
         "Who wrote Hamlet?"],
        ["Sing me a song.", "Who painted the Mona Lisa?"],
        FALLBACK_ANSWER,
    ),
}  # fmt: skip

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are mlx-trio-demo, a helpful assistant.",
    "Be concise.",
    "You are a friendly assistant. Answer briefly.",
]

HELDOUT_PAIR_FRACTION = 0.1

# Tool schemas: names, parameter names and descriptions, training and held
# out. A place parameter takes the place as the user names it; a timezone
# parameter an IANA name.
TOOL_NAMES = {
    "weather": {
        "train": ["get_weather", "weather", "get_current_weather", "current_weather",
                  "fetch_weather", "weather_lookup", "lookup_weather", "get_forecast",
                  "weather_now", "getWeather", "get_weather_data"],
        "heldout": ["check_weather", "weather_report", "query_weather", "get_weather_info"],
    },
    "time": {
        "train": ["get_time", "get_current_time", "current_time", "local_time",
                  "get_local_time", "time_now", "clock", "fetch_time", "getTime",
                  "world_clock"],
        "heldout": ["check_time", "lookup_time", "get_clock_time", "time_lookup"],
    },
}  # fmt: skip
PARAM_NAMES = {
    "place": {
        "train": ["city", "location", "place", "town", "city_name", "location_name",
                  "place_name", "cityName", "where", "name"],
        "heldout": ["locality", "destination", "city_or_town", "loc", "area"],
    },
    "tz": {
        "train": ["timezone", "tz", "zone", "timezone_name", "iana_timezone", "tz_name",
                  "timeZone"],
        "heldout": ["time_zone", "tz_id", "iana_zone", "zone_name"],
    },
}  # fmt: skip
TOOL_DESCRIPTIONS = {
    "weather": {
        "train": ["Get the current weather in a city.", "Get the weather for a city.",
                  "Look up the current weather conditions for a given city.",
                  "Get the weather for a location.", "Returns the temperature and conditions.",
                  "Weather lookup.", "Current weather at a place.", None],
        "heldout": ["Fetch today's weather for somewhere.",
                    "Report the weather conditions at a location."],
    },
    "time": {
        "train": ["Get the current local time in a timezone.",
                  "Get the current time for an IANA timezone.",
                  "Return the local time in the given timezone.", "Get the current time in a city.",
                  "Look up what time it is somewhere.", "Local time lookup.", None],
        "heldout": ["Tells the time at a location.", "Current clock time for a place or zone."],
    },
}  # fmt: skip
PARAM_DESCRIPTIONS = {
    "place": {
        "train": [None, None, "The city name", "Name of the city, e.g. Paris", "City or town",
                  "The location to look up", "Where to look", "A place name"],
        "heldout": [None, "A place name such as Lisbon", "The city, for example Rome"],
    },
    "tz": {
        "train": [None, None, "IANA timezone name, e.g. Europe/Paris", "The timezone",
                  "Timezone such as America/New_York", "An IANA timezone"],
        "heldout": [None, "An IANA time zone like Asia/Tokyo", "Time zone identifier"],
    },
}  # fmt: skip

# Syllables for made-up place names: weather questions about them teach the
# model to copy any city name into the tool call, not only the known ones.
_ONSETS = ["B", "K", "M", "T", "V", "L", "R", "S", "D", "N", "P", "G", "H", "F",
           "Br", "St", "Tr", "Gr", "Kl", "Sh", "Ch", "Z", "W", "Y", "J", "C", "A", "E", "O"]  # fmt: skip
_NUCLEI = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "ie", "y", "ay"]
_CODAS = ["", "", "", "n", "r", "l", "s", "m", "th", "nd", "rk", "st", "g", "b", "z"]
_SUFFIXES = ["ton", "ville", "burg", "ford", "polis", "stad", "holm", "ia", "ora", "ano",
             "grad", "mouth", "field", "ore", "is", "ey"]  # fmt: skip
_PREFIXES = ["Port", "San", "New", "Lake", "Mount", "Saint", "Fort", "El", "La"]
_SUFFIX_WORDS = ["City", "Bay", "Falls", "Springs", "Heights", "Beach", "Town"]
# Random-letter words (``Generator._made_up_word``): place names to copy, fillers.
_LETTER_ONSETS = [
    *"bcdfghjklmnpqrstvwxyz",
    "th", "sh", "ch", "ph", "wh", "st", "sp", "sk", "sl", "sm", "sn", "sw", "str", "spr",
    "bl", "br", "cl", "cr", "dr", "fl", "fr", "gl", "gr", "kr", "pl", "pr", "tr", "tw",
    "qu", "kn", "wr", "sch", "ts", "zh", "kh", "dj",
]  # fmt: skip
_LETTER_VOWELS = [*"aeiouy", "aa", "ae", "ai", "au", "ea", "ee", "ei", "eu", "ia", "ie", "io",
                  "oa", "oe", "oi", "oo", "ou", "ua", "ue", "ui", "y"]  # fmt: skip
_LETTER_CODAS = ["", "", "", *"bcdfgklmnprstvxz", "ck", "ng", "nk", "nd", "nt", "rd", "rk",
                 "rn", "rt", "ll", "ss", "st", "sk", "th", "sh", "ch", "gh", "lm", "lt",
                 "mb", "mp", "ft", "x", "tz", "rg", "lk"]  # fmt: skip
# Fillers around training questions (None: a made-up word). None of them,
# with a training phrasing, makes a held-out phrasing.
_FILLER_PREFIXES = [
    "Hey, ", "Hi, ", "Hello! ", "OK, ", "Ok so ", "So, ", "Well, ", "Um, ", "Hmm, ",
    "Right, ", "Now, ", "Also, ", "And ", "Next: ", "One more: ", "Excuse me, ", "Sorry, ",
    "Yo, ", "Alright, ", "Hey there, ", "Good morning! ", "Another one: ", "Hi assistant, ",
    "Question: ", "Assistant, ", "Friend, ", "Dear bot, ", "Okay. ", "Then ", "Hm. ",
    None, None, None, None,
]  # fmt: skip
_FILLER_SUFFIXES = [" please", ", please", " thanks", ", thanks!", " thx", " :)", " ?", "!!",
                    " now", " ok?", " asap", ", mate", None, None]  # fmt: skip
# Words that must never be made up as an operation: they mean one.
_OPERATION_WORDS = {"plus", "minus", "add", "and", "sum", "take", "away", "subtract", "from"}

# Real English words for made-up tool and parameter names (recipe 3), besides
# random-letter words: names of two or three pieces joined by "_" or in
# camelCase teach the model to copy a name piece by piece, also where a
# piece is a word it knows from elsewhere (``query``, ``zone``, ``city``).
# ``_NAME_WORDS[kind]`` fit a tool of that kind or a parameter of that kind;
# a held-out name never comes out (``is_heldout_name``).
_COMMON_NAME_WORDS = [
    "get", "fetch", "query", "check", "lookup", "find", "read", "show", "report", "info",
    "data", "value", "name", "id", "code", "key", "input", "target", "main", "my", "user",
    "current", "local", "live", "latest", "now", "today", "api", "service", "tool",
    "request", "status", "text", "field", "label", "arg", "param", "string", "world",
    "global", "search", "simple", "quick", "full", "default", "primary",
]  # fmt: skip
_NAME_WORDS = {
    "weather": ["weather", "forecast", "temp", "temperature", "climate", "conditions", "rain",
                "sky", "meteo"],
    "time": ["time", "clock", "hour", "datetime", "moment", "date", "now"],
    "place": ["city", "town", "place", "location", "where", "region", "site", "spot",
              "country", "address", "geo", "village", "point", "municipality"],
    "tz": ["zone", "timezone", "tz", "iana", "time", "offset", "olson"],
}  # fmt: skip
# Recipe 4: the name of a parameter says which value it takes. Every
# timezone-kind made-up parameter name has one of these pieces (``zone``
# twice as often: the held-out ``time_zone``, ``iana_zone`` and
# ``zone_name`` have it); ``time`` and ``offset`` may join them but are no
# cue on their own (``local_time`` could take a place).
TZ_CUES = ("zone", "timezone", "tz", "iana", "olson")
_TZ_CUE_DRAWS = ("zone", "zone", "timezone", "tz", "tz", "iana", "olson")
# A place-kind made-up parameter name contains none of these, not even
# inside a made-up word (``blitz_city``, ``stimey``): where training names
# took a place, a timezone word never appears.
NOT_IN_PLACE_NAMES = (*TZ_CUES, "time", "offset")
# Share of the training examples declaring a weather and a time tool whose
# two names share a stem and differ in one piece (``fetch_forecast`` /
# ``fetch_clock``, ``zorbWeatherApi`` / ``zorbTimeApi``): the held-out
# ``check_weather`` / ``check_time`` differ only in their last piece.
SAME_STEM_SHARE = 0.25
# Shared pieces of such names: verbs (``check`` among them), made-up words
# and common words, never a word of either kind (``now`` is a time word).
_STEM_VERBS = ["get", "fetch", "query", "check", "lookup", "find", "read", "show", "report"]


# ---------------------------------------------------------------------------
# Tools
# ---------------------------------------------------------------------------


def _function(name: str, description: str | None, params: dict[str, dict], required: list[str]):
    function: dict[str, Any] = {"name": name}
    if description:
        function["description"] = description
    function["parameters"] = {"type": "object", "properties": params, "required": required}
    return {"type": "function", "function": function}


@dataclasses.dataclass(frozen=True)
class ToolSpec:
    """One weather or time tool as the request declares it.

    ``param_kind`` is "place" (the argument is the place as the user names
    it) or "tz" (an IANA timezone name).
    """

    kind: str  # "weather" or "time"
    name: str
    param: str
    param_kind: str
    schema: dict

    def call(self, place: str, tz: str | None = None) -> dict:
        value = tz if self.param_kind == "tz" else place
        return {"name": self.name, "arguments": {self.param: value}}


def standard_tool(kind: str) -> ToolSpec:
    """``get_weather(city)`` or ``get_time(timezone)``, as README.md and the tests declare them."""
    if kind == "weather":
        schema = _function(
            "get_weather",
            "Get the current weather in a city.",
            {"city": {"type": "string"}},
            ["city"],
        )
        return ToolSpec("weather", "get_weather", "city", "place", schema)
    schema = _function(
        "get_time",
        "Get the current local time in a timezone.",
        {"timezone": {"type": "string"}},
        ["timezone"],
    )
    return ToolSpec("time", "get_time", "timezone", "tz", schema)


def distractor_tools() -> list[dict]:
    s = {"type": "string"}
    return [
        _function("search_web", "Search the web for a query.", {"query": s}, ["query"]),
        _function("get_stock_price", "Get the latest stock price.", {"symbol": s}, ["symbol"]),
        _function(
            "send_email", "Send an email.", {"to": s, "subject": s, "body": s}, ["to", "subject"]
        ),
        _function(
            "convert_currency",
            "Convert an amount between currencies.",
            {"amount": {"type": "number"}, "from_currency": s, "to_currency": s},
            ["amount", "from_currency", "to_currency"],
        ),
        _function(
            "translate",
            "Translate text into a language.",
            {"text": s, "language": s},
            ["text", "language"],
        ),  # fmt: skip
        _function("get_news", "Get the latest news headlines.", {"topic": s}, []),
    ]


def tool_call_text(name: str, arguments: dict) -> str:
    """The reply for one tool call, exactly as the chat template renders it."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments, ensure_ascii=False)}}}\n</tool_call>'


def name_pieces(name: str) -> list[str]:
    """The lower-case pieces of a snake_case or camelCase name: ``cityOr_town`` -> city, or, town."""
    return re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower().split("_")


HELDOUT_NAME_PIECES = [
    name_pieces(name)
    for table in (TOOL_NAMES, PARAM_NAMES)
    for lists in table.values()
    for name in lists["heldout"]
]


def is_heldout_name(name: str) -> bool:
    """Whether the pieces of a held-out tool or parameter name (any kind, any
    casing) occur in ``name`` one after the other: ``query_weather``,
    ``queryWeather``, ``get_query_weather``, ``loc_id``. Made-up training
    names never do, so that held-out names stay unseen."""
    pieces = name_pieces(name)
    return any(
        pieces[i : i + len(held)] == held
        for held in HELDOUT_NAME_PIECES
        for i in range(len(pieces) - len(held) + 1)
    )


def has_tz_cue(name: str) -> bool:
    """Whether a piece of ``name`` says timezone (``TZ_CUES``): ``blorp_zone``,
    ``ianaKey``, ``tz``; not ``local_time`` or ``timezoned``."""
    return any(piece in TZ_CUES for piece in name_pieces(name))


def fits_param_kind(name: str, param_kind: str) -> bool:
    """Recipe 4's rule for made-up parameter names: a timezone-kind name has a
    timezone cue, a place-kind name no timezone word anywhere in it."""
    if param_kind == "tz":
        return has_tz_cue(name)
    lower = name.lower()
    return not any(word in lower for word in NOT_IN_PLACE_NAMES)


def _reordered(rng: random.Random, mapping: dict) -> dict:
    items = list(mapping.items())
    rng.shuffle(items)
    return dict(items)


def shuffled_schema(rng: random.Random, schema: dict) -> dict:
    """``schema`` (a ``{"type": "function", "function": ...}`` tool) with its
    keys in another order: always the function object's (``name``,
    ``description``, ``parameters``), sometimes the parameters object's, each
    property's, the properties' and the outer object's. The chat template
    renders the tool with ``tojson``, which keeps the order."""
    function = dict(schema["function"])
    if "parameters" in function:
        params = dict(function["parameters"])
        props = {
            key: _reordered(rng, prop) if rng.random() < 0.3 else prop
            for key, prop in params.get("properties", {}).items()
        }
        if len(props) > 1 and rng.random() < 0.5:
            props = _reordered(rng, props)
        params["properties"] = props
        function["parameters"] = _reordered(rng, params) if rng.random() < 0.3 else params
    function = _reordered(rng, function)
    if rng.random() < 0.2:
        return {"function": function, "type": schema["type"]}
    return {"type": schema["type"], "function": function}


# ---------------------------------------------------------------------------
# Arithmetic
# ---------------------------------------------------------------------------

_PLACES = ("units", "tens", "hundreds")


def arith_result(op: str, a: int, b: int) -> int:
    return a + b if op == "+" else a - b


def arith_trace(op: str, a: int, b: int) -> str:
    """The working for ``a op b`` (0 <= a, b <= 999): digit by digit, units first.

    ``47 + 85: units 7 + 5 = 12, tens 4 + 8 + 1 = 13, so 132``;
    ``305 - 128: compare hundreds 3 > 1; units 15 - 8 = 7, tens 10 - 2 - 1 = 7,
    hundreds 3 - 1 - 1 = 1, so 177``;
    ``23 - 58: compare tens 2 < 5, so -(58 - 23); units 8 - 3 = 5, tens 5 - 2 - 0 = 3,
    so -35``.
    Each step names its place, reads one digit of each number (0 where a
    number has no such digit) and the carry (or borrow) of the step before;
    a subtraction step that borrows writes its top digit plus 10. A
    subtraction first compares the numbers digit by digit from the highest
    place down to the first difference (all of them when they are equal) and
    swaps them when the first is smaller. The result is the last step's
    value followed by the last digits of the steps before, leading zeros
    dropped. Every step is a lookup that a small model learns for all pairs,
    which the whole sum (or the comparison) at once is not.
    """
    if not (0 <= a <= MAX_NUMBER and 0 <= b <= MAX_NUMBER):
        raise ValueError(f"operands must be 0..{MAX_NUMBER}: {a}, {b}")
    n = len(str(max(a, b)))
    head = f"{a} {op} {b}: "
    top, low = a, b
    if op == "-":
        relations = []
        for i in reversed(range(n)):
            x, y = a // 10**i % 10, b // 10**i % 10
            relations.append(f"{_PLACES[i]} {x} {'<' if x < y else '>' if x > y else '='} {y}")
            if x != y:
                break
        head += "compare " + ", ".join(relations)
        if a < b:
            top, low = b, a
            head += f", so -({b} - {a}); "
        else:
            head += "; "
    steps = []
    carry = 0
    for i in range(n):
        x, y = top // 10**i % 10, low // 10**i % 10
        if op == "+":
            value = x + y + carry
            expr = f"{x} + {y}" if i == 0 else f"{x} + {y} + {carry}"
            carry = value // 10
        else:
            borrow = int(x - y - carry < 0)
            shown = x + 10 * borrow
            value = shown - y - carry
            expr = f"{shown} - {y}" if i == 0 else f"{shown} - {y} - {carry}"
            carry = borrow
        steps.append(f"{_PLACES[i]} {expr} = {value}")
    return f"{head}{', '.join(steps)}, so {arith_result(op, a, b)}"


def arith_reply(op: str, a: int, b: int, thinking: bool) -> str:
    """The whole assistant reply to ``a op b``, without the end token.

    With thinking on, the working in the think block and the bare result
    after it; with thinking off the working is the reply (it ends in the
    result): the model never states a result it has not worked out.
    """
    trace = arith_trace(op, a, b)
    if thinking:
        return f"<think>\n{trace}\n</think>\n\n{arith_result(op, a, b)}"
    return trace


def is_heldout_pair(op: str, a: int, b: int) -> bool:
    """Whether ``(op, a, b)`` is kept for evaluation: a fixed hash, 10 % of all pairs."""
    h = ((a * 1000 + b) * 2 + (op == "-")) * 0x9E3779B1 + SPLIT_SEED
    h &= 0xFFFFFFFF
    h ^= h >> 15
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    return h % 1000 < HELDOUT_PAIR_FRACTION * 1000


# ---------------------------------------------------------------------------
# Split
# ---------------------------------------------------------------------------


def _split_list(rng: random.Random, items: Sequence, n_held: int) -> tuple[list, list]:
    idx = list(range(len(items)))
    rng.shuffle(idx)
    held = set(idx[:n_held])
    return [x for i, x in enumerate(items) if i not in held], [
        x for i, x in enumerate(items) if i in held
    ]


@dataclasses.dataclass(frozen=True)
class Split:
    """Disjoint training / held-out cities, phrasings and tool vocabulary.

    Cities are drawn from ``seed``; number pairs are split by
    ``is_heldout_pair``; phrasings, operations, tool names, parameter names
    and descriptions are the fixed lists above.
    """

    cities: dict[str, list[str]]
    weather: dict[str, list[str]]
    time: dict[str, list[str]]
    arith: dict[str, list[str]]
    intents: dict[str, dict[str, list[str]]]

    @classmethod
    def make(cls, seed: int = SPLIT_SEED) -> Split:
        rng = random.Random(seed)
        eligible = [c for c in CITIES if c not in TIMEZONE_PLACES]
        _, held_cities = _split_list(rng, eligible, N_HELDOUT_CITIES)
        cities = {
            "train": [c for c in CITIES if c not in held_cities],
            "heldout": held_cities,
        }
        intents = {
            name: {"train": train, "heldout": held} for name, (train, held, _) in INTENTS.items()
        }
        return cls(cities, WEATHER_PHRASINGS, TIME_PHRASINGS, ARITH_PHRASINGS, intents)


@functools.cache
def _default_split() -> Split:
    return Split.make()


# ---------------------------------------------------------------------------
# Examples
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Example:
    """A conversation that ends where the assistant must reply, and that reply."""

    kind: str
    messages: list[dict[str, Any]]
    tools: list[dict] | None
    thinking: bool
    target: str  # the assistant reply, without the end token
    expect: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Share of each kind among training examples. Arithmetic examples are short
# (no tool block most of the time) and need the most repetitions, so they
# are most of the examples but a minority of the tokens.
TRAIN_MIX = {
    "arith": 0.47,
    "arith_refuse": 0.12,
    "chat": 0.10,
    "weather_call": 0.095,
    "weather_answer": 0.04,
    "time_call": 0.085,
    "time_answer": 0.03,
    "no_tool": 0.06,
}
# Training tools with a made-up name, and (independently) with a made-up
# parameter name; training tools declared with their keys in another order.
MADE_UP_NAME_SHARE = 0.5
SHUFFLED_SCHEMA_SHARE = 0.45
THINKING_SHARE = 0.5  # thinking on (the template default) vs off
ARITH_THINKING_SHARE = 0.45
# Held-out kinds. "weather_call" / "time_call" declare the standard tools
# (get_weather(city), get_time(timezone)) with held-out phrasings and
# cities; the "_schema" kinds declare tools with held-out names, parameter
# names and descriptions.
EVAL_KINDS = (
    "weather_call",
    "time_call",
    "weather_call_schema",
    "time_call_schema",
    "weather_answer",
    "time_answer",
    "no_tool",
    "arith_think",
    "arith_nothink",
    "arith_refuse",
    "chat",
)
# How many held-out examples of a kind per "n" of the evaluation.
EVAL_WEIGHTS = {"arith_think": 4, "arith_nothink": 4, "arith_refuse": 3}
ARITH_KINDS = ("arith_think", "arith_nothink", "arith_refuse")


class Generator:
    """Draws examples of one split ("train" or "heldout") from ``seed``."""

    def __init__(self, split: str = "train", seed: int | str = 0, splits: Split | None = None):
        if split not in ("train", "heldout"):
            raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
        self.split = split
        self.rng = random.Random(f"{split}-{seed}")
        self.s = splits or _default_split()

    # -- small helpers -------------------------------------------------------

    def _casing(self, template: str) -> str:
        """Vary the surface of a phrasing (before names are filled in)."""
        r = self.rng.random()
        if r < 0.2:
            template = template.lower()
        elif r < 0.3:
            template = template[:1].upper() + template[1:]
        if self.rng.random() < 0.15 and template[-1:] in "?.!":
            template = template[:-1]
        return template

    def _question(self, templates: Sequence[str], **fields: str) -> str:
        return self._wrap(self._casing(self.rng.choice(templates)).format(**fields))

    def _wrap(self, question: str) -> str:
        """Training only: maybe a filler before and after the question.

        Fillers are generic (``Hey,``, ``Right,``, a made-up word, ...) and
        never form a held-out phrasing; they teach the model to find the
        request inside text it has not seen, which is what held-out
        phrasings need.
        """
        rng = self.rng
        if self.split != "train":
            return question
        if rng.random() < 0.4:
            prefix = rng.choice(_FILLER_PREFIXES)
            if prefix is None:
                prefix = self._made_up_word() + rng.choice([", ", ": ", " ", "! "])
            if rng.random() < 0.5:
                prefix = prefix.lower()
            if rng.random() < 0.6:
                question = question[:1].lower() + question[1:]
            question = prefix + question
        if rng.random() < 0.2:
            if rng.random() < 0.5:
                question = question.rstrip("?.!")
            suffix = rng.choice(_FILLER_SUFFIXES)
            question += suffix if suffix is not None else " " + self._made_up_word().lower()
        return question

    def _made_up_word(self, syllables: Sequence[int] = (1, 1, 2, 2, 2, 3)) -> str:
        """Random letters with common English clusters: any token piece can turn up."""
        rng = self.rng
        parts = []
        for _ in range(rng.choice(syllables)):
            onset = rng.choice(_LETTER_ONSETS) if rng.random() < 0.8 else ""
            parts.append(onset + rng.choice(_LETTER_VOWELS) + rng.choice(_LETTER_CODAS))
        word = "".join(parts)
        return word[:1].upper() + word[1:]

    def _made_up_place(self) -> str:
        rng = self.rng
        if rng.random() < 0.5:
            name = self._made_up_word()
        else:
            n = rng.choice([1, 2, 2, 3])
            name = "".join(
                rng.choice(_ONSETS).lower() + rng.choice(_NUCLEI) + rng.choice(_CODAS)
                for _ in range(n)
            )
        if rng.random() < 0.4:
            name += rng.choice(_SUFFIXES)
        name = name[:1].upper() + name[1:]
        r = rng.random()
        if r < 0.15:
            name = f"{rng.choice(_PREFIXES)} {name}"
        elif r < 0.25:
            name = f"{name} {rng.choice(_SUFFIX_WORDS)}"
        return name

    def _city(self) -> str:
        if self.split == "train" and self.rng.random() < 0.5:
            return self._made_up_place()
        return self.rng.choice(self.s.cities[self.split])

    def _system(self, p: float = 0.3) -> list[dict]:
        if self.rng.random() < p:
            return [{"role": "system", "content": self.rng.choice(SYSTEM_PROMPTS)}]
        return []

    # -- tools ---------------------------------------------------------------

    def _tool(self, kind: str, param_kind: str | None = None, name: str | None = None) -> ToolSpec:
        """A weather or time tool with a name, parameter and descriptions of this split.

        Training also makes up tool names and parameter names (half of the
        tools each, ``_made_up_tool_name`` and ``_made_up_param``; a made-up
        parameter has a description that says what it takes, a made-up tool
        without "weather" or "time" in its name one that says what it does),
        so that the model learns to copy whatever names the schema declares
        instead of recalling the names it has seen most; and 45 % of the
        training tools have their keys in another order (``shuffled_schema``).
        ``name`` (training only): this made-up name (``_same_stem_names``).
        """
        rng = self.rng
        split = self.split
        given_name = name
        if param_kind is None:
            param_kind = "place" if kind == "weather" or rng.random() < 0.5 else "tz"
        name = rng.choice(TOOL_NAMES[kind][split])
        param = rng.choice(PARAM_NAMES[param_kind][split])
        param_note = rng.choice(PARAM_DESCRIPTIONS[param_kind][split])
        made_up_name = split == "train" and rng.random() < MADE_UP_NAME_SHARE
        if split == "train" and rng.random() < MADE_UP_NAME_SHARE:
            param = self._made_up_param(param_kind)
            param_note = rng.choice(PARAM_DESCRIPTIONS[param_kind]["train"][2:])
        if given_name is not None:
            name, made_up_name = given_name, True
        elif made_up_name:
            name = self._made_up_tool_name(kind)
        description = rng.choice(TOOL_DESCRIPTIONS[kind][split])
        if made_up_name and kind not in name:
            # only the description says what the tool does
            description = rng.choice([d for d in TOOL_DESCRIPTIONS[kind]["train"] if d])
        prop: dict[str, Any] = {"type": "string"}
        if param_note:
            prop["description"] = param_note
        props = {param: prop}
        if rng.random() < 0.2:  # an optional parameter, never filled in
            if kind == "weather":
                extra = rng.choice(["unit", "units"])
                props[extra] = {"type": "string", "enum": ["celsius", "fahrenheit"]}
            else:
                props[rng.choice(["format", "hour_format"])] = {
                    "type": "string",
                    "enum": ["12h", "24h"],
                }
            if rng.random() < 0.5:
                props = dict(reversed(list(props.items())))
        schema = _function(name, description, props, [param])
        if split == "train" and rng.random() < SHUFFLED_SCHEMA_SHARE:
            schema = shuffled_schema(rng, schema)
        return ToolSpec(kind, name, param, param_kind, schema)

    def _name_word(self, kind: str) -> str:
        """One piece of a made-up name: a made-up word, a common word or a word of ``kind``."""
        rng = self.rng
        r = rng.random()
        if r < 0.45:
            return self._made_up_word((1, 1, 2)).lower()
        if r < 0.75:
            return rng.choice(_COMMON_NAME_WORDS)
        return rng.choice(_NAME_WORDS[kind])

    def _join_name(self, pieces: list[str]) -> str:
        """snake_case (75 %) or camelCase."""
        if self.rng.random() < 0.75:
            return "_".join(pieces)
        return pieces[0] + "".join(p[:1].upper() + p[1:] for p in pieces[1:])

    def _made_up_tool_name(self, kind: str) -> str:
        """A tool name the model has to copy: a made-up stem around the kind
        (``zorb_weather``, ``get_zorb``), or two or three pieces of made-up
        words, common words and words of the kind (``fetchSkyZorb``,
        ``query_live_forecast``); never a held-out name."""
        rng = self.rng
        while True:
            if rng.random() < 0.35:
                stem = self._made_up_word().lower()
                name = rng.choice(
                    [f"{stem}_{kind}", f"{kind}_{stem}", f"get_{kind}_{stem}", stem, f"get_{stem}"]
                )
            else:
                pieces = [self._name_word(kind) for _ in range(rng.choice([2, 2, 3]))]
                if rng.random() < 0.5:  # the kind's own word somewhere
                    pieces[rng.randrange(len(pieces))] = kind
                name = self._join_name(pieces)
            if not is_heldout_name(name) and len(set(name_pieces(name))) == len(name_pieces(name)):
                return name

    def _made_up_param(self, param_kind: str) -> str:
        """A parameter name the model has to copy: one made-up word with
        maybe a suffix (``blorp_id``), a trained name with a word before or
        after (``zorb_zone``, ``city_name_zorb``), two names joined by ``or``
        (``city_or_zorb``), or two or three pieces (``lookupTownKey``); never
        a held-out name.

        Recipe 4: the name says which value the parameter takes
        (``fits_param_kind``). A timezone-kind name always has a piece of
        ``TZ_CUES`` (the made-up word comes with one, ``blorp_zone``,
        ``tzBlorp``; where two or three pieces have none, one of them is
        replaced by one); a place-kind name has no timezone word in it, and
        only a place-kind name may be a made-up word alone.
        """
        rng = self.rng
        while True:
            r = rng.random()
            if r < 0.3:
                word = self._made_up_word().lower()
                if param_kind == "tz":
                    pieces = [word, rng.choice(_TZ_CUE_DRAWS)]
                    if rng.random() < 0.4:
                        pieces.reverse()
                    param = self._join_name(pieces)
                else:
                    param = word + rng.choice(["", "", "_name", "_id", "_value"])
            elif r < 0.55:
                trained = rng.choice(PARAM_NAMES[param_kind]["train"])
                word = self._name_word(param_kind)
                param = rng.choice([f"{word}_{trained}", f"{trained}_{word}"])
            elif r < 0.7:
                a, b = self._name_word(param_kind), self._name_word(param_kind)
                if rng.random() < 0.5:
                    a = rng.choice(_NAME_WORDS[param_kind])
                pieces = self._with_tz_cue([a, b], param_kind)
                param = self._join_name([pieces[0], "or", pieces[1]])
            else:
                pieces = [self._name_word(param_kind) for _ in range(rng.choice([2, 2, 3]))]
                param = self._join_name(self._with_tz_cue(pieces, param_kind))
            pieces = name_pieces(param)
            if (
                not is_heldout_name(param)
                and len(set(pieces)) == len(pieces)
                and fits_param_kind(param, param_kind)
            ):
                return param

    def _with_tz_cue(self, pieces: list[str], param_kind: str) -> list[str]:
        """``pieces``, one of them replaced by a timezone cue where a
        timezone-kind name has none."""
        if param_kind != "tz" or any(p in TZ_CUES for p in pieces):
            return pieces
        pieces = list(pieces)
        pieces[self.rng.randrange(len(pieces))] = self.rng.choice(_TZ_CUE_DRAWS)
        return pieces

    def _stem_piece(self) -> str:
        """A piece shared by the names of a same-stem pair: a verb, a made-up
        word or a common word, never a word of the weather or time kind."""
        rng = self.rng
        kind_words = set(_NAME_WORDS["weather"] + _NAME_WORDS["time"]) | {"weather", "time"}
        while True:
            r = rng.random()
            if r < 0.4:
                piece = rng.choice(_STEM_VERBS)
            elif r < 0.7:
                piece = self._made_up_word((1, 1, 2)).lower()
            else:
                piece = rng.choice(_COMMON_NAME_WORDS)
            if piece not in kind_words:
                return piece

    def _same_stem_names(self) -> dict[str, str]:
        """A weather and a time tool name (training only) that share every piece
        but one, that one a word of each kind: ``fetch_forecast`` /
        ``fetch_clock``, ``zorb_weather`` / ``zorb_time``, ``getWeatherApi`` /
        ``getTimeApi``, ``weather_live`` / ``time_live``. The kind's own word
        half of the time; never a held-out name (``check_weather`` /
        ``check_time`` are redrawn, ``check_forecast`` / ``check_clock`` are
        not)."""
        rng = self.rng
        distractors = {t["function"]["name"] for t in distractor_tools()}
        while True:
            stem = [self._stem_piece() for _ in range(rng.choice([1, 1, 1, 2]))]
            r = rng.random()
            at = len(stem) if r < 0.6 else 0 if r < 0.85 or len(stem) == 1 else 1
            camel = self.rng.random() >= 0.75
            names = {}
            for kind in ("weather", "time"):
                word = kind if rng.random() < 0.5 else rng.choice(_NAME_WORDS[kind])
                pieces = [*stem[:at], word, *stem[at:]]
                if camel:
                    names[kind] = pieces[0] + "".join(p[:1].upper() + p[1:] for p in pieces[1:])
                else:
                    names[kind] = "_".join(pieces)
            if names["weather"] != names["time"] and not any(
                is_heldout_name(n)
                or n in distractors
                or len(set(name_pieces(n))) != len(name_pieces(n))
                for n in names.values()
            ):
                return names

    def _tools(
        self,
        need: ToolSpec | None = None,
        avoid: str | None = None,
        p_any: float = 1.0,
        partner: ToolSpec | None = None,
    ) -> list[dict] | None:
        """A shuffled tool list holding ``need`` (and ``partner``) and maybe
        others (never a tool of kind ``avoid``), or None. In training, a
        weather and a time tool drawn here share a stem ``SAME_STEM_SHARE``
        of the time (``_same_stem_names``)."""
        rng = self.rng
        if need is None and rng.random() >= p_any:
            return None
        tools = [need.schema] if need is not None else []
        have = {need.kind} if need is not None else set()
        if partner is not None:
            tools.append(partner.schema)
            have.add(partner.kind)
        if self.split == "train" and not have and avoid is None:
            kinds = [kind for kind in ("weather", "time") if rng.random() < 0.5]
            names: dict[str, str | None] = dict.fromkeys(kinds)
            if len(kinds) == 2 and rng.random() < SAME_STEM_SHARE:
                names = dict(self._same_stem_names())
            tools += [self._tool(kind, name=name).schema for kind, name in names.items()]
        else:
            # (the held-out split draws exactly as recipe 3 did)
            for kind in ("weather", "time"):
                if kind not in have and kind != avoid and rng.random() < 0.5:
                    tools.append(self._tool(kind).schema)
        if rng.random() < 0.3 or not tools:
            distractor = rng.choice(distractor_tools())
            if self.split == "train" and rng.random() < SHUFFLED_SCHEMA_SHARE:
                distractor = shuffled_schema(rng, distractor)
            tools.append(distractor)
        rng.shuffle(tools)
        return tools

    def _call_tool(self, kind: str, standard: bool = False) -> tuple[ToolSpec, ToolSpec | None]:
        """The tool to call, and in training now and then a tool of the other
        kind whose name shares its stem (to declare with it; else None).

        ``_tools`` adds a tool of the other kind half of the time, so a pair
        drawn here ``s / (2 - s)`` of the time makes ``SAME_STEM_SHARE`` (s)
        of the examples with both kinds declared same-stem pairs.
        """
        if standard:
            return standard_tool(kind), None
        if self.split == "train" and self.rng.random() < SAME_STEM_SHARE / (2 - SAME_STEM_SHARE):
            names = self._same_stem_names()
            other = "time" if kind == "weather" else "weather"
            return self._tool(kind, name=names[kind]), self._tool(other, name=names[other])
        return self._tool(kind), None

    # -- arithmetic ----------------------------------------------------------

    def _operand(self) -> int:
        r = self.rng.random()
        if r < 0.15:
            return self.rng.randint(0, 9)
        if r < 0.45:
            return self.rng.randint(10, 99)
        return self.rng.randint(100, MAX_NUMBER)

    def _hard_pair(self, op: str) -> tuple[int, int]:
        """Pairs with long carry or borrow chains and results near 0 or 1000."""
        rng = self.rng
        a = self._operand()
        if op == "+":
            k = rng.choice([1, 2, 3])
            b = 10**k - a % 10**k + rng.randint(-2, 2)
        elif rng.random() < 0.5:
            b = a + rng.randint(-12, 12)
        else:
            a = rng.choice([10, 100]) * rng.randint(1, 9) + rng.randint(0, 1)
            b = rng.randint(0, 120)
        return a, min(max(b, 0), MAX_NUMBER)

    def _pair(self) -> tuple[str, int, int]:
        rng = self.rng
        want_heldout = self.split == "heldout"
        while True:
            op = rng.choice("+-")
            if rng.random() < 0.2:
                a, b = self._hard_pair(op)
            else:
                a, b = self._operand(), self._operand()
            if rng.random() < 0.5:
                a, b = b, a
            if is_heldout_pair(op, a, b) == want_heldout:
                return op, a, b

    def _arith_template(self, op: str | None) -> str:
        """A phrasing of this split; ``op`` None: one with an operator slot."""
        rng = self.rng
        while True:
            template = rng.choice(self.s.arith[self.split])
            if template[:2] in ("+:", "-:"):
                if template[0] != op:
                    continue
                template = template[2:]
            elif op is None and "{x}" not in template and "{w}" not in template:
                continue
            return self._casing(template)

    def _arith_question(self, op: str, a: int | str, b: int | str) -> str:
        template = self._arith_template(op)
        word = "plus" if op == "+" else "minus"
        return self._wrap(template.format(a=a, b=b, x=op, w=word))

    def _big_number(self) -> str:
        rng = self.rng
        digits = rng.choice([4, 4, 4, 5, 5, 6, 7, 8, 9])
        n = rng.randint(10 ** (digits - 1), 10**digits - 1)
        if rng.random() < 0.3:
            n = rng.choice([1000, 1001, 9999, 10000, 999999, 1000000, 1999, 2000, 100000])
        if self.split == "train" and rng.random() < 0.15:
            return f"{n:,}"
        return str(n)

    def _decimal(self) -> str:
        """A decimal number; its whole part as often short as an operand's (``2.5``)."""
        rng = self.rng
        places = rng.choice([1, 1, 2])
        return f"{self._operand()}.{rng.randint(0, 10**places - 1):0{places}d}"

    def _refusal_question(self) -> tuple[str, str]:
        """A numeric request other than one sum or difference of 0..999, and its category."""
        rng = self.rng
        split = self.split
        categories = {
            "big": 0.30,
            "other_op": 0.18,
            "request": 0.22,
            "decimal": 0.09,
            "negative": 0.07,
            "three": 0.06,
        }
        if split == "train":
            categories["made_up"] = 0.12
        category = rng.choices(list(categories), weights=list(categories.values()), k=1)[0]
        small = {"a": self._operand(), "b": self._operand(), "c": self._operand()}
        if category == "big":
            op = rng.choice("+-")
            a = self._big_number()
            b = str(self._operand()) if rng.random() < 0.6 else self._big_number()
            if rng.random() < 0.5:
                a, b = b, a
            return self._arith_question(op, a, b), category
        if category == "negative":
            op = rng.choice("+-")
            a, b = f"-{self._operand()}", str(self._operand())
            if rng.random() < 0.3:
                b = f"-{b}"
            if rng.random() < 0.5:
                a, b = b, a
            return self._arith_question(op, a, b), category
        if category == "three":
            op, inner = rng.choice("+-"), rng.choice("+-")
            a = f"{self._operand()} {inner} {self._operand()}"
            b = str(self._operand())
            if rng.random() < 0.5:
                a, b = b, a
            return self._arith_question(op, a, b), category
        if category == "decimal":
            op = rng.choice("+-")
            a = self._decimal()
            b = self._decimal() if rng.random() < 0.5 else str(self._operand())
            if rng.random() < 0.5:
                a, b = b, a
            return self._arith_question(op, a, b), category
        if category == "other_op":
            template = self._arith_template(None)
            ops = OTHER_OPS[split]
            x, w = rng.choice(ops["x"]), rng.choice(ops["w"])
            return self._wrap(template.format(**small, x=x, w=w)), category
        if category == "made_up":
            op = self._made_up_word().lower()
            while op in _OPERATION_WORDS:
                op = self._made_up_word().lower()
            template = self._casing(rng.choice(MADE_UP_OPERATIONS))
            fields = {**small, "op": op, "Op": op[:1].upper() + op[1:]}
            return self._wrap(template.format(**fields)), category
        template = self._casing(rng.choice(NUMERIC_REQUESTS[split]))
        x = rng.choice(OTHER_OPS[split]["x"] + ["+", "-"])
        fields = {**small, "d": self._decimal(), "d2": self._decimal(), "x": x}
        if rng.random() < 0.2:
            fields["a"] = self._big_number()
        return self._wrap(template.format(**fields)), category

    # -- other requests ------------------------------------------------------

    def _intent(self, name: str | None = None) -> tuple[str, str]:
        rng = self.rng
        if name is None:
            name = rng.choices(list(INTENTS), weights=[3, 1, 2, 2, 1, 1, 3], k=1)[0]
        if name == "offtopic" and self.split == "train" and rng.random() < 0.25:
            # Words it has never seen: anything it cannot place gets the fallback.
            return self._unknown_request(), INTENTS[name][2]
        phrasing = rng.choice(self.s.intents[name][self.split])
        phrasing = self._casing(phrasing)
        question = phrasing.format(a=rng.randint(0, 99), b=rng.randint(1, 99))
        return self._wrap(question), INTENTS[name][2]

    def _unknown_request(self) -> str:
        """A sentence of made-up words (training only): a request nobody can serve."""
        rng = self.rng
        words = [self._made_up_word() for _ in range(rng.randint(1, 5))]
        words = [w if rng.random() < 0.3 else w.lower() for w in words]
        words[0] = words[0][:1].upper() + words[0][1:]
        return " ".join(words) + rng.choice(["?", ".", "!", ""])

    def _weather_result(self) -> dict[str, Any]:
        rng = self.rng
        result: dict[str, Any] = {
            "temperature": rng.randint(-15, 40),
            "condition": rng.choice(CONDITIONS),
        }
        if rng.random() < 0.3:
            result["humidity"] = rng.randint(10, 99)
        if rng.random() < 0.2:
            items = list(result.items())
            rng.shuffle(items)
            result = dict(items)
        return result

    def _time_place(self, tool: ToolSpec | None = None) -> tuple[str, str]:
        """A place to ask the time of, and its IANA zone ("" when it has none).

        For a tool that takes a place, any city (or a made-up one); for one
        that takes a timezone, a place of ``TIMEZONE_PLACES`` or the zone itself.
        """
        rng = self.rng
        if tool is not None and tool.param_kind == "place" and rng.random() < 0.6:
            place = self._city()
            return place, TIMEZONE_PLACES.get(place, "")
        place = rng.choice(sorted(TIMEZONE_PLACES))
        tz = TIMEZONE_PLACES[place]
        if (tool is None or tool.param_kind == "tz") and place != "UTC" and rng.random() < 0.15:
            place = tz  # the user names the timezone itself
        return place, tz

    def _history(self, p: float) -> list[dict]:
        """With probability ``p``, one or two earlier exchanges, as a client sends them back."""
        rng = self.rng
        history: list[dict] = []
        if self.split != "train" or rng.random() >= p:
            return history
        for _ in range(rng.choice([1, 1, 2])):
            kind = rng.choice(["chat", "arith", "weather"])
            if kind == "chat":
                q, a = self._intent()
                history += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            elif kind == "arith":
                op, a, b = self._pair()
                history += [
                    {"role": "user", "content": self._arith_question(op, a, b)},
                    {"role": "assistant", "content": str(arith_result(op, a, b))},
                ]
            else:
                messages, _, _, answer = self._weather_exchange(self._tool("weather"))
                history += [*messages, {"role": "assistant", "content": answer}]
        return history

    def _weather_exchange(self, tool: ToolSpec) -> tuple[list[dict], str, dict, str]:
        """user ask, assistant tool call, tool result; and the final answer."""
        rng = self.rng
        city = self._city()
        question = self._question(self.s.weather[self.split], city=city)
        result = self._weather_result()
        answer = f"It is {result['temperature']} degrees and {result['condition']} in {city}."
        messages = [
            {"role": "user", "content": question},
            _assistant_call(rng, tool.call(city)),
            {"role": "tool", "content": json.dumps(result)},
        ]
        return messages, city, result, answer

    # -- examples ------------------------------------------------------------

    def example(self, kind: str | None = None) -> Example:
        rng = self.rng
        if kind is None:
            kind = rng.choices(list(TRAIN_MIX), weights=list(TRAIN_MIX.values()), k=1)[0]
        thinking = rng.random() < THINKING_SHARE
        if kind == "arith":
            thinking = rng.random() < ARITH_THINKING_SHARE
        elif kind == "arith_think":
            kind, thinking = "arith", True
        elif kind == "arith_nothink":
            kind, thinking = "arith", False
        if kind in ("arith", "arith_refuse"):
            system, history = self._system(0.15), self._history(0.15)
        else:
            system, history = self._system(), self._history(0.4)
        # Held-out calls: the standard tools, or ("_schema") held-out schemas.
        standard = self.split == "heldout" and not kind.endswith("_schema")
        kind = kind.removesuffix("_schema")

        if kind == "chat":
            question, answer = self._intent()
            tools = self._tools(p_any=0.25)
            messages = [*system, *history, {"role": "user", "content": question}]
            return Example("chat", messages, tools, thinking, answer, {"answer": answer})

        if kind == "arith":
            op, a, b = self._pair()
            r = arith_result(op, a, b)
            tools = self._tools(p_any=0.1)
            messages = [
                *system,
                *history,
                {"role": "user", "content": self._arith_question(op, a, b)},
            ]
            target = arith_reply(op, a, b, thinking)
            name = "arith_think" if thinking else "arith_nothink"
            expect = {"answer": r, "op": op, "a": a, "b": b}
            return Example(name, messages, tools, thinking, target, expect)

        if kind == "arith_refuse":
            question, category = self._refusal_question()
            tools = self._tools(p_any=0.1)
            messages = [*system, *history, {"role": "user", "content": question}]
            expect = {"answer": ARITH_REFUSAL, "category": category}
            return Example(kind, messages, tools, thinking, ARITH_REFUSAL, expect)

        if kind in ("weather_call", "weather_answer"):
            tool, partner = self._call_tool("weather", standard)
            exchange, city, result, answer = self._weather_exchange(tool)
            tools = self._tools(need=tool, partner=partner)
            if kind == "weather_call":
                messages = [*system, *history, exchange[0]]
                call = tool.call(city)
                target = tool_call_text(**call)
                name = kind if standard or self.split == "train" else "weather_call_schema"
                return Example(name, messages, tools, thinking, target, {"call": call})
            messages = [*system, *history, *exchange]
            expect = {
                "answer": answer,
                "mentions": [str(result["temperature"]), result["condition"]],
            }
            return Example(kind, messages, tools, thinking, answer, expect)

        if kind in ("time_call", "time_answer"):
            tool, partner = self._call_tool("time", standard)
            place, tz = self._time_place(tool)
            question = self._question(self.s.time[self.split], place=place)
            tools = self._tools(need=tool, partner=partner)
            call = tool.call(place, tz)
            if kind == "time_call":
                messages = [*system, *history, {"role": "user", "content": question}]
                name = kind if standard or self.split == "train" else "time_call_schema"
                return Example(
                    name, messages, tools, thinking, tool_call_text(**call), {"call": call}
                )
            hh, mm = rng.randint(0, 23), rng.randint(0, 59)
            clock = f"{hh:02d}:{mm:02d}"
            where = tz if tool.param_kind == "tz" else place
            result = {tool.param if rng.random() < 0.5 else "timezone": where, "time": clock}
            if rng.random() < 0.2:
                result = {"time": clock}
            elif rng.random() < 0.2:
                result = dict(reversed(list(result.items())))
            answer = f"It is {clock} in {place}."
            messages = [
                *system,
                *history,
                {"role": "user", "content": question},
                _assistant_call(rng, call),
                {"role": "tool", "content": json.dumps(result)},
            ]
            return Example(
                kind, messages, tools, thinking, answer, {"answer": answer, "mentions": [clock]}
            )

        if kind == "no_tool":
            # asked for weather or time without a tool for it
            if rng.random() < 0.55:
                city = self._city()
                question = self._question(self.s.weather[self.split], city=city)
                answer = (
                    f"I can't check the weather in {city} because no weather tool is available."
                )
                tools = self._tools(avoid="weather", p_any=0.6)
            else:
                place, _ = self._time_place(
                    None if rng.random() < 0.5 else self._tool("time", "place")
                )
                question = self._question(self.s.time[self.split], place=place)
                answer = f"I can't check the time in {place} because no time tool is available."
                tools = self._tools(avoid="time", p_any=0.6)
            messages = [*system, *history, {"role": "user", "content": question}]
            return Example(kind, messages, tools, thinking, answer, {"answer": answer})

        raise ValueError(f"unknown example kind {kind!r}")


def _assistant_call(rng: random.Random, call: dict) -> dict:
    """An assistant tool-call message as an OpenAI client sends it back."""
    arguments = call["arguments"]
    args: Any = json.dumps(arguments) if rng.random() < 0.7 else dict(arguments)
    return {
        "role": "assistant",
        "content": rng.choice([None, ""]),
        "tool_calls": [
            {
                "id": f"call_{rng.getrandbits(32):08x}",
                "type": "function",
                "function": {"name": call["name"], "arguments": args},
            }
        ],
    }


def generate(n: int, seed: int = 0, split: str = "train", kind: str | None = None) -> list[Example]:
    gen = Generator(split, seed)
    return [gen.example(kind) for _ in range(n)]


def heldout_set(
    n_per_kind: int, seed: int = 0, weights: dict[str, int] | None = None
) -> list[Example]:
    """Held-out examples of each kind in ``EVAL_KINDS``: ``n_per_kind`` each,
    times ``weights[kind]`` where given (``EVAL_WEIGHTS`` for the evaluation)."""
    gen = Generator("heldout", seed)
    weights = weights or {}
    return [
        gen.example(kind) for kind in EVAL_KINDS for _ in range(n_per_kind * weights.get(kind, 1))
    ]


# ---------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------


def _new_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _hf_wrapper(tokenizer: Tokenizer):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=EOS, pad_token=PAD, clean_up_tokenization_spaces=False
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def render_prompt(hf_tokenizer, example: Example) -> str:
    """The prompt text the server builds for this conversation."""
    return hf_tokenizer.apply_chat_template(
        example.messages,
        tools=example.tools,
        add_generation_prompt=True,
        enable_thinking=example.thinking,
        tokenize=False,
    )


def build_tokenizer(seed: int = 0, vocab_size: int = VOCAB_SIZE, n_corpus: int = 4000) -> Tokenizer:
    """Byte-level BPE trained on rendered training conversations."""
    bootstrap = _hf_wrapper(_new_tokenizer())
    corpus = [
        render_prompt(bootstrap, ex) + ex.target + EOS for ex in generate(n_corpus, seed=seed)
    ]
    tokenizer = _new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return tokenizer


def write_tokenizer(tokenizer: Tokenizer, out_dir: str | os.PathLike) -> pathlib.Path:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {"eos_token": EOS, "pad_token": PAD}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return out


def load_hf_tokenizer(model_dir: str | os.PathLike):
    """The transformers tokenizer of a model dir, as ``mlx_lm.load`` builds it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def encode(hf_tokenizer, examples: Sequence[Example]) -> list[tuple[list[int], list[int]]]:
    """(token ids, loss mask) per example: the mask is 1 on the reply and its end token."""
    backend = hf_tokenizer.backend_tokenizer
    prompts = [render_prompt(hf_tokenizer, ex) for ex in examples]
    replies = [ex.target + EOS for ex in examples]
    p_enc = backend.encode_batch(prompts, add_special_tokens=False)
    r_enc = backend.encode_batch(replies, add_special_tokens=False)
    out = []
    for p, r in zip(p_enc, r_enc, strict=True):
        out.append((p.ids + r.ids, [0] * len(p.ids) + [1] * len(r.ids)))
    return out


POOL_CHUNK = 2048  # examples per generation chunk; each chunk has its own seed

_WORKER_TOKENIZER = None


def _worker_init(tokenizer_dir: str) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = load_hf_tokenizer(tokenizer_dir)


def _pool_chunk(job: tuple[int, int, int]) -> tuple[list[np.ndarray], list[np.ndarray], list[str]]:
    seed, index, size = job
    gen = Generator("train", f"{seed}-{index}")
    examples = [gen.example() for _ in range(size)]
    encoded = encode(_WORKER_TOKENIZER, examples)
    ids = [np.asarray(i, dtype=np.int32) for i, _ in encoded]
    masks = [np.asarray(m, dtype=np.uint8) for _, m in encoded]
    return ids, masks, [ex.kind for ex in examples]


def build_pool(
    tokenizer_dir: str | os.PathLike, n: int, seed: int = 0, workers: int | None = None
) -> tuple[list[np.ndarray], list[np.ndarray], list[str]]:
    """``n`` encoded training examples: token ids, loss masks and kinds.

    Chunk ``i`` of ``POOL_CHUNK`` examples is drawn from seed ``f"{seed}-{i}"``
    and rendered with the tokenizer in ``tokenizer_dir``, in worker processes
    when there are many (rendering the chat template is pure Python); the
    result depends on ``n`` and ``seed`` only, not on the number of workers.
    """
    import concurrent.futures
    import multiprocessing

    jobs = [
        (seed, i, min(POOL_CHUNK, n - start)) for i, start in enumerate(range(0, n, POOL_CHUNK))
    ]
    workers = min(workers or os.cpu_count() or 1, 16, len(jobs))
    ids: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    kinds: list[str] = []
    if workers <= 1:
        _worker_init(str(tokenizer_dir))
        parts = map(_pool_chunk, jobs)
        for part in parts:
            ids += part[0]
            masks += part[1]
            kinds += part[2]
        return ids, masks, kinds
    with concurrent.futures.ProcessPoolExecutor(
        workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_worker_init,
        initargs=(str(tokenizer_dir),),
    ) as pool:
        for part in pool.map(_pool_chunk, jobs):
            ids += part[0]
            masks += part[1]
            kinds += part[2]
    return ids, masks, kinds
