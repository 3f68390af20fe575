"""Synthetic conversations and the tokenizer for the mlx-trio-demo model.

Everything here is a pure function of its seeds:

* ``Split`` fixes which cities, number pairs and phrasings are for training
  and which are held out for evaluation. It depends only on ``SPLIT_SEED``, so
  every training seed is scored on the same held-out prompts.
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
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import random
from collections.abc import Iterable, Sequence
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
VOCAB_SIZE = 1024
EOS = "<|im_end|>"
PAD = "<|endoftext|>"
MAX_NUMBER = 99

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

# get_time: a dozen IANA timezones, and the places a user names them by.
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
    ],
    "heldout": [
        "Could you tell me the time in {place}?",
        "Do you know what time it is in {place}?",
        "What's the local time over in {place}?",
    ],
}
# "{x}" is an operator symbol (+ or -), "{w}" an operator word (plus/minus);
# "+:" / "-:" prefixes restrict a phrasing to one operation.
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
    ],
    "heldout": [
        "Please work out {a} {x} {b}.",
        "+:Can you add {a} and {b} for me?",
        "Quick question: what is {a} {w} {b}?",
        "-:Could you subtract {b} from {a}?",
        "I need {a} {x} {b}.",
    ],
}

# Fixed-answer intents: training phrasings, held-out phrasings, the answer.
SKILLS_ANSWER = (
    "I can greet you, answer a few questions about myself, add and subtract "
    "whole numbers from 0 to 99, and call the get_weather and get_time tools "
    "when you provide them."
)
FALLBACK_ANSWER = (
    "Sorry, I can't help with that. I can only chat a little, add and subtract "
    "numbers from 0 to 99, and use the weather and time tools."
)
INTENTS: dict[str, tuple[list[str], list[str], str]] = {
    "greet": (
        ["Hello", "Hi", "Hey", "Hello there", "Hi there", "Good morning", "Good evening",
         "Hey there", "Greetings", "Hello!", "Hi!", "Howdy", "Hello again", "Hey hey",
         "Hi friend", "Morning", "Hey assistant", "Yo", "Hi, bot"],
        ["Good afternoon", "Hiya", "Hello, assistant"],
        "Hello! How can I help you today?",
    ),
    "how": (
        ["How are you?", "How are you doing?", "How's it going?", "How do you do?",
         "How have you been?", "How is your day?", "You doing okay?", "Are you well?",
         "How are you feeling?"],
        ["How are you today?", "How are things?"],
        "I'm doing well, thank you! How can I help you today?",
    ),
    "who": (
        ["Who are you?", "What are you?", "What is your name?", "What's your name?",
         "Introduce yourself.", "Tell me about yourself.", "Are you a bot?", "Who is this?",
         "Who made you?", "What model are you?", "Are you human?", "Identify yourself.",
         "Which assistant is this?", "Who is speaking?", "Do you have a name?"],
        ["Who am I talking to?", "What should I call you?", "Who are you exactly?"],
        "I am mlx-trio-demo, a tiny language model trained to demo mlx-trio-server.",
    ),
    "skills": (
        ["What can you do?", "What are your skills?", "Help", "How can you help me?",
         "What do you know how to do?", "What are you able to do?", "What do you do?",
         "Tell me what you can do.", "What are you good at?", "What can I ask you?",
         "Show me what you can do.", "What are your abilities?", "Any skills?",
         "How are you useful?", "What is your job?"],
        ["What can you help me with?", "Which tasks can you do?", "What can you do for me?"],
        SKILLS_ANSWER,
    ),
    "thanks": (
        ["Thanks", "Thank you", "Thanks a lot", "Thank you very much", "Thanks!", "Cheers",
         "Appreciate it", "Thank you kindly", "Great, thanks", "Perfect, thank you", "Ta"],
        ["Many thanks", "Thank you so much"],
        "You're welcome!",
    ),
    "bye": (
        ["Bye", "Goodbye", "See you", "See you later", "Good night", "Farewell",
         "Catch you later", "See ya", "Later!", "I have to go now", "That's all for now",
         "Bye bye"],
        ["Bye for now", "Talk to you later"],
        "Goodbye! Have a nice day.",
    ),
    "offtopic": (
        ["Tell me a joke.", "Write a poem about the sea.", "What is the capital of France?",
         "Who won the World Cup?", "Translate hello into Spanish.",
         "What is the meaning of life?", "Can you write some Python code?",
         "Recommend a good book.", "What is {a} times {b}?", "Divide {a} by {b}.",
         "What is the square root of {a}?", "Tell me a story.", "What's the news today?",
         "Play some music.", "Book a flight for me.", "Order a pizza.",
         "Set an alarm for {a} minutes.", "What is the population of Japan?",
         "Explain quantum physics.", "Write an email to my boss.", "How do I cook pasta?",
         "What's a good movie?", "Draw a cat.", "Remind me to call mom.",
         "What is {a} to the power of {b}?", "Give me a recipe.", "Who is the president?"],
        ["Sing me a song.", "What is {a} multiplied by {b}?", "Who painted the Mona Lisa?"],
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


# ---------------------------------------------------------------------------
# Tools
# ---------------------------------------------------------------------------


def _function(name: str, description: str, params: dict[str, dict], required: list[str]):
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": params, "required": required},
        },
    }


def weather_tool(rng: random.Random) -> dict:
    description = rng.choice(
        [
            "Get the current weather in a city.",
            "Get the weather for a city.",
            "Look up the current weather conditions for a given city.",
        ]
    )
    city: dict[str, Any] = {"type": "string"}
    note = rng.choice([None, "The city name", "Name of the city, e.g. Paris"])
    if note:
        city["description"] = note
    return _function("get_weather", description, {"city": city}, ["city"])


def time_tool(rng: random.Random) -> dict:
    description = rng.choice(
        [
            "Get the current local time in a timezone.",
            "Get the current time for an IANA timezone.",
            "Return the local time in the given timezone.",
        ]
    )
    tz: dict[str, Any] = {"type": "string"}
    note = rng.choice([None, "IANA timezone name, e.g. Europe/Paris", "The timezone"])
    if note:
        tz["description"] = note
    return _function("get_time", description, {"timezone": tz}, ["timezone"])


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
    ]


def tool_call_text(name: str, arguments: dict) -> str:
    """The reply for one tool call, exactly as the chat template renders it."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments, ensure_ascii=False)}}}\n</tool_call>'


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
    """Disjoint training / held-out cities, number pairs and phrasings.

    Cities and number pairs are drawn from ``seed``; phrasings are the fixed
    lists above.
    """

    cities: dict[str, list[str]]
    weather: dict[str, list[str]]
    time: dict[str, list[str]]
    arith: dict[str, list[str]]
    intents: dict[str, dict[str, list[str]]]
    heldout_pairs: frozenset[tuple[str, int, int]]

    @classmethod
    def make(cls, seed: int = SPLIT_SEED) -> Split:
        rng = random.Random(seed)
        eligible = [c for c in CITIES if c not in TIMEZONE_PLACES]
        _, held_cities = _split_list(rng, eligible, N_HELDOUT_CITIES)
        cities = {
            "train": [c for c in CITIES if c not in held_cities],
            "heldout": held_cities,
        }

        weather = WEATHER_PHRASINGS
        time = TIME_PHRASINGS
        arith = ARITH_PHRASINGS
        intents = {
            name: {"train": train, "heldout": held} for name, (train, held, _) in INTENTS.items()
        }
        pairs = [
            (op, a, b) for op in "+-" for a in range(MAX_NUMBER + 1) for b in range(MAX_NUMBER + 1)
        ]
        held_pairs = frozenset(rng.sample(pairs, round(len(pairs) * HELDOUT_PAIR_FRACTION)))
        return cls(cities, weather, time, arith, intents, held_pairs)


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
    "arith": 0.70,
    "chat": 0.085,
    "weather_call": 0.085,
    "weather_answer": 0.045,
    "time_call": 0.035,
    "time_answer": 0.03,
    "no_tool": 0.02,
}
THINKING_SHARE = 0.5  # thinking on (the template default) vs off
ARITH_THINKING_SHARE = 0.4  # the bare answer is the harder skill: more of it
EVAL_KINDS = (
    "weather_call",
    "time_call",
    "weather_answer",
    "time_answer",
    "arith_think",
    "arith_nothink",
    "chat",
)


class Generator:
    """Draws examples of one split ("train" or "heldout") from ``seed``."""

    def __init__(self, split: str = "train", seed: int | str = 0, splits: Split | None = None):
        if split not in ("train", "heldout"):
            raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
        self.split = split
        self.rng = random.Random(f"{split}-{seed}")
        self.s = splits or _default_split()
        self._train_pairs: list[tuple[str, int, int]] | None = None
        if split == "train":
            pairs = [
                (op, a, b)
                for op in "+-"
                for a in range(MAX_NUMBER + 1)
                for b in range(MAX_NUMBER + 1)
            ]
            self._pairs = [p for p in pairs if p not in self.s.heldout_pairs]
        else:
            self._pairs = sorted(self.s.heldout_pairs)

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

    def _made_up_word(self) -> str:
        """Random letters with common English clusters: any token piece can turn up."""
        rng = self.rng
        parts = []
        for _ in range(rng.choice([1, 1, 2, 2, 2, 3])):
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

    def _tools(self, need: Iterable[str] = (), p_any: float = 1.0) -> list[dict] | None:
        """A shuffled tool list holding ``need`` and maybe others, or None."""
        rng = self.rng
        need = set(need)
        if not need and rng.random() >= p_any:
            return None
        names = set(need)
        for name in ("get_weather", "get_time"):
            if name not in names and rng.random() < 0.5:
                names.add(name)
        tools = []
        if "get_weather" in names:
            tools.append(weather_tool(rng))
        if "get_time" in names:
            tools.append(time_tool(rng))
        if rng.random() < 0.3:
            tools.append(rng.choice(distractor_tools()))
        if not tools:
            tools.append(rng.choice(distractor_tools()))
        rng.shuffle(tools)
        return tools

    def _pair(self) -> tuple[str, int, int]:
        return self.rng.choice(self._pairs)

    @staticmethod
    def _result(op: str, a: int, b: int) -> int:
        return a + b if op == "+" else a - b

    def _arith_question(self, op: str, a: int, b: int) -> str:
        rng = self.rng
        while True:
            template = rng.choice(self.s.arith[self.split])
            if template[:2] in ("+:", "-:"):
                if template[0] != op:
                    continue
                template = template[2:]
            break
        template = self._casing(template)
        word = "plus" if op == "+" else "minus"
        return self._wrap(template.format(a=a, b=b, x=op, w=word))

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

    def _time_place(self) -> tuple[str, str]:
        rng = self.rng
        place = rng.choice(sorted(TIMEZONE_PLACES))
        tz = TIMEZONE_PLACES[place]
        if place != "UTC" and rng.random() < 0.15:
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
                    {"role": "assistant", "content": str(self._result(op, a, b))},
                ]
            else:
                messages, _, _, answer = self._weather_exchange()
                history += [*messages, {"role": "assistant", "content": answer}]
        return history

    def _weather_exchange(self) -> tuple[list[dict], str, dict, str]:
        """user ask, assistant tool call, tool result; and the final answer."""
        rng = self.rng
        city = self._city()
        question = self._question(self.s.weather[self.split], city=city)
        result = self._weather_result()
        answer = f"It is {result['temperature']} degrees and {result['condition']} in {city}."
        messages = [
            {"role": "user", "content": question},
            _assistant_call(rng, "get_weather", {"city": city}),
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
        if kind == "arith":
            system, history = self._system(0.15), self._history(0.15)
        else:
            system, history = self._system(), self._history(0.4)

        if kind == "chat":
            question, answer = self._intent()
            tools = self._tools(p_any=0.25)
            messages = [*system, *history, {"role": "user", "content": question}]
            return Example("chat", messages, tools, thinking, answer, {"answer": answer})

        if kind == "arith":
            op, a, b = self._pair()
            r = self._result(op, a, b)
            tools = self._tools(p_any=0.1)
            messages = [
                *system,
                *history,
                {"role": "user", "content": self._arith_question(op, a, b)},
            ]
            target = f"<think>\n{arith_trace(op, a, b)}\n</think>\n\n{r}" if thinking else str(r)
            name = "arith_think" if thinking else "arith_nothink"
            return Example(name, messages, tools, thinking, target, {"answer": r})

        if kind in ("weather_call", "weather_answer"):
            exchange, city, result, answer = self._weather_exchange()
            tools = self._tools(need=["get_weather"])
            if kind == "weather_call":
                messages = [*system, *history, exchange[0]]
                call = {"name": "get_weather", "arguments": {"city": city}}
                target = tool_call_text(**call)
                return Example(kind, messages, tools, thinking, target, {"call": call})
            messages = [*system, *history, *exchange]
            expect = {
                "answer": answer,
                "mentions": [str(result["temperature"]), result["condition"]],
            }
            return Example(kind, messages, tools, thinking, answer, expect)

        if kind in ("time_call", "time_answer"):
            place, tz = self._time_place()
            question = self._question(self.s.time[self.split], place=place)
            tools = self._tools(need=["get_time"])
            call = {"name": "get_time", "arguments": {"timezone": tz}}
            if kind == "time_call":
                messages = [*system, *history, {"role": "user", "content": question}]
                return Example(
                    kind, messages, tools, thinking, tool_call_text(**call), {"call": call}
                )
            hh, mm = rng.randint(0, 23), rng.randint(0, 59)
            clock = f"{hh:02d}:{mm:02d}"
            result = {"timezone": tz, "time": clock}
            if rng.random() < 0.2:
                result = {"time": clock, "timezone": tz}
            answer = f"It is {clock} in {place}."
            messages = [
                *system,
                *history,
                {"role": "user", "content": question},
                _assistant_call(rng, "get_time", {"timezone": tz}),
                {"role": "tool", "content": json.dumps(result)},
            ]
            return Example(
                kind, messages, tools, thinking, answer, {"answer": answer, "mentions": [clock]}
            )

        if kind == "no_tool":
            # asked for weather or time without the tool for it
            if rng.random() < 0.6:
                city = self._city()
                question = self._question(self.s.weather[self.split], city=city)
                answer = (
                    f"I can't check the weather in {city} because no weather tool is available."
                )
                tools = self._tools(p_any=0.4)
                tools = [t for t in tools or [] if t["function"]["name"] != "get_weather"] or None
            else:
                place, _ = self._time_place()
                question = self._question(self.s.time[self.split], place=place)
                answer = f"I can't check the time in {place} because no time tool is available."
                tools = self._tools(p_any=0.4)
                tools = [t for t in tools or [] if t["function"]["name"] != "get_time"] or None
            messages = [*system, *history, {"role": "user", "content": question}]
            return Example(kind, messages, tools, thinking, answer, {"answer": answer})

        raise ValueError(f"unknown example kind {kind!r}")


def arith_trace(op: str, a: int, b: int) -> str:
    """The reasoning for ``a op b``: digit by digit, units first, then the result.

    ``47 + 85: 7 + 5 = 12, 4 + 8 + 1 = 13, so 132``;
    ``85 - 47: 15 - 7 = 8, 8 - 4 - 1 = 3, so 38``;
    ``47 - 85 = -(85 - 47): 15 - 7 = 8, 8 - 4 - 1 = 3, so -38``.
    Every step reads a digit or two and a carry, which a small model learns
    far sooner than the whole sum at once.
    """
    if op == "+":
        a1, a0 = divmod(a, 10)
        b1, b0 = divmod(b, 10)
        carry = (a0 + b0) // 10
        steps = f"{a0} + {b0} = {a0 + b0}, {a1} + {b1} + {carry} = {a1 + b1 + carry}"
        return f"{a} + {b}: {steps}, so {a + b}"
    hi, lo = (a, b) if a >= b else (b, a)
    h1, h0 = divmod(hi, 10)
    l1, l0 = divmod(lo, 10)
    borrow = int(h0 < l0)
    top = h0 + 10 * borrow
    steps = f"{top} - {l0} = {top - l0}, {h1} - {l1} - {borrow} = {h1 - l1 - borrow}"
    head = f"{a} - {b}" if a >= b else f"{a} - {b} = -({b} - {a})"
    return f"{head}: {steps}, so {a - b}"


def _assistant_call(rng: random.Random, name: str, arguments: dict) -> dict:
    """An assistant tool-call message as an OpenAI client sends it back."""
    args: Any = json.dumps(arguments) if rng.random() < 0.7 else dict(arguments)
    return {
        "role": "assistant",
        "content": rng.choice([None, ""]),
        "tool_calls": [
            {
                "id": f"call_{rng.getrandbits(32):08x}",
                "type": "function",
                "function": {"name": name, "arguments": args},
            }
        ],
    }


def generate(n: int, seed: int = 0, split: str = "train", kind: str | None = None) -> list[Example]:
    gen = Generator(split, seed)
    return [gen.example(kind) for _ in range(n)]


def heldout_set(n_per_kind: int, seed: int = 0) -> list[Example]:
    """``n_per_kind`` held-out examples of each kind in ``EVAL_KINDS``."""
    gen = Generator("heldout", seed)
    return [gen.example(kind) for kind in EVAL_KINDS for _ in range(n_per_kind)]


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
