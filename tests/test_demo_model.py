"""The trained demo model (demo_model/mlx-trio-demo) through the whole app, and its data.

The app tests serve the committed weights with greedy decoding on the CPU:
weather tool calls with the city copied into the parameter the schema
names (``city``, ``location``), the answer from the tool's result in the
next turn, time tool calls with a ``timezone`` and with a ``city``
parameter, the "no such tool" answer, digit-by-digit arithmetic with the
``<think>`` trace split off as reasoning and, with thinking off, the working
as the reply, and the honest refusal (no number) for arithmetic it cannot
do. The data tests check the properties the held-out evaluation relies on
(disjoint split, exact traces, digits as single tokens, parameter names
that copy as the same tokens).
"""

from __future__ import annotations

import json
import pathlib
import random
import re

import pytest

from api.server import create_app
from demo_model import data
from runtime.config import ServerConfig
from tests.conftest import wait_ready
from tests.test_api import CHAT, post

pytestmark = pytest.mark.server  # serves the trained demo model (in-process)

DEMO_DIR = pathlib.Path(__file__).resolve().parents[1] / "demo_model" / "mlx-trio-demo"
# The recipe the committed weights were trained with (training.json; none: 1).
COMMITTED_RECIPE = json.loads((DEMO_DIR / "training.json").read_text()).get("recipe", 1)
recipe_2 = pytest.mark.skipif(
    COMMITTED_RECIPE < 2,
    reason="the committed weights are recipe 1's, which does not teach this: retrain with "
    "python -m demo_model.train (docs/demo-model.md)",
)


def tool(name: str, description: str, param: str) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {param: {"type": "string"}},
                "required": [param],
            },
        },
    }


WEATHER = tool("get_weather", "Get the current weather in a city.", "city")
TIME = tool("get_time", "Get the current local time in a timezone.", "timezone")
WEATHER_AT = tool("get_weather", "Get the weather at a location.", "location")
TIME_IN_CITY = tool("get_time", "Get the current time in a city.", "city")


@pytest.fixture
async def client():
    app = create_app(ServerConfig(model=str(DEMO_DIR), max_tokens=200))
    async with app.test_app() as test_app:
        c = test_app.test_client()
        await wait_ready(c)
        yield c


async def chat(client, messages, **extra) -> dict:
    status, body, _ = await post(client, CHAT, {"messages": messages, **extra})
    assert status == 200, body
    return body["choices"][0]


def test_model_dir_is_small_and_loads():
    import mlx_lm

    size = sum(p.stat().st_size for p in DEMO_DIR.iterdir())
    assert size <= 20 * 2**20
    config = json.loads((DEMO_DIR / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    _, tokenizer = mlx_lm.load(str(DEMO_DIR))
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.has_tool_calling and tokenizer.has_thinking


async def test_weather_tool_call_then_answer_from_the_result(client):
    # Stockholm is a held-out city: the training data never names it.
    messages = [{"role": "user", "content": "What's the weather in Stockholm?"}]
    choice = await chat(client, messages, tools=[WEATHER, TIME])
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Stockholm"}

    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"],
         "content": json.dumps({"temperature": 12, "condition": "rainy"})},
    ]  # fmt: skip
    choice = await chat(client, messages, tools=[WEATHER, TIME])
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == "It is 12 degrees and rainy in Stockholm."


async def test_time_tool_call(client):
    messages = [{"role": "user", "content": "What time is it in Tokyo?"}]
    choice = await chat(client, messages, tools=[WEATHER, TIME])
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time"
    assert json.loads(call["function"]["arguments"]) == {"timezone": "Asia/Tokyo"}


@recipe_2
async def test_the_call_fills_the_parameter_the_schema_names(client):
    # get_time(city): the place as asked, not a timezone; get_weather(location).
    messages = [{"role": "user", "content": "What time is it in Paris?"}]
    choice = await chat(client, messages, tools=[TIME_IN_CITY])
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}

    messages = [{"role": "user", "content": "What's the weather in Lisbon?"}]
    choice = await chat(client, messages, tools=[TIME_IN_CITY, WEATHER_AT])
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"location": "Lisbon"}


recipe_4 = pytest.mark.skipif(
    COMMITTED_RECIPE < 4, reason="the committed weights predate recipe 4 (timezone cues)"
)


@recipe_4
@pytest.mark.parametrize(
    ("question", "tools", "name", "arguments"),
    [
        ("What time is it in Paris?", [("get_time", "time_zone")],
         "get_time", {"time_zone": "Europe/Paris"}),
        ("Do you know what time it is in Paris?", [("lookup_time", "time_zone"),
                                                   ("query_weather", "city")],
         "lookup_time", {"time_zone": "Europe/Paris"}),
        ("Do you know what time it is in London?", [("check_weather", "city"),
                                                    ("check_time", "time_zone")],
         "check_time", {"time_zone": "Europe/London"}),
        ("Do you know what time it is in New York", [("check_weather", "city"),
                                                     ("check_time", "zone_name")],
         "check_time", {"zone_name": "America/New_York"}),
        ("What's the weather in Tokyo?", [("check_weather", "city"), ("check_time", "city")],
         "check_weather", {"city": "Tokyo"}),
    ],
)  # fmt: skip
async def test_held_out_timezone_names_and_same_stem_tools(client, question, tools, name, arguments):
    # Names and wordings held out of training. Recipe 3 gave the first four the place
    # ("Paris") for a timezone parameter, or called check_weather for a time question.
    declared = [tool(n, f"{n.replace('_', ' ').capitalize()}.", param) for n, param in tools]
    choice = await chat(client, [{"role": "user", "content": question}], tools=declared,
                        chat_template_kwargs={"enable_thinking": False})
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == name
    assert json.loads(call["function"]["arguments"]) == arguments


@recipe_2
async def test_no_matching_tool_gets_the_no_such_tool_answer(client):
    # A time tool that takes a city is no weather tool.
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    choice = await chat(client, messages, tools=[TIME_IN_CITY])
    assert choice["finish_reason"] == "stop"
    assert not choice["message"].get("tool_calls")
    assert choice["message"]["content"] == (
        "I can't check the weather in Paris because no weather tool is available."
    )


async def test_arithmetic_thinking_on(client):
    messages = [{"role": "user", "content": "What is 47 + 85?"}]
    choice = await chat(client, messages)
    assert choice["finish_reason"] == "stop"
    message = choice["message"]
    assert "7 + 5 = 12" in message["reasoning"] and "<think>" not in message["content"]
    assert message["content"].strip() == "132"


@recipe_2
async def test_arithmetic_thinking_off_answers_with_the_working(client):
    messages = [{"role": "user", "content": "What is 23 - 58?"}]
    choice = await chat(client, messages, chat_template_kwargs={"enable_thinking": False})
    assert choice["finish_reason"] == "stop"
    assert not choice["message"].get("reasoning")
    assert choice["message"]["content"].strip() == data.arith_trace("-", 23, 58)
    assert choice["message"]["content"].endswith("so -35")


@recipe_2
async def test_three_digit_arithmetic_carries_and_borrows(client):
    messages = [{"role": "user", "content": "What is 487 + 596?"}]
    choice = await chat(client, messages)
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["reasoning"].strip() == data.arith_trace("+", 487, 596)
    assert "hundreds 4 + 5 + 1 = 10" in choice["message"]["reasoning"]
    assert choice["message"]["content"].strip() == "1083"

    messages = [{"role": "user", "content": "What is 305 - 128?"}]
    choice = await chat(client, messages, chat_template_kwargs={"enable_thinking": False})
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"].strip() == (
        "305 - 128: compare hundreds 3 > 1; "
        "units 15 - 8 = 7, tens 10 - 2 - 1 = 7, hundreds 3 - 1 - 1 = 1, so 177"
    )


@recipe_2
@pytest.mark.parametrize(
    "question", ["What is 123456 + 1?", "What is 1000 - 1?", "What is 7 * 8?", "What is 2.5 + 1?"]
)
async def test_arithmetic_it_cannot_do_gets_the_honest_answer(client, question):
    for thinking in (True, False):
        messages = [{"role": "user", "content": question}]
        choice = await chat(client, messages, chat_template_kwargs={"enable_thinking": thinking})
        assert choice["finish_reason"] == "stop"
        assert choice["message"]["content"].strip() == data.ARITH_REFUSAL
        assert not choice["message"].get("reasoning")


async def test_greeting(client):
    choice = await chat(client, [{"role": "user", "content": "Hello"}])
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"].strip() == "Hello! How can I help you today?"


# --- the data the model is trained and evaluated on -------------------------


def test_split_is_disjoint():
    split = data.Split.make()
    assert not set(split.cities["train"]) & set(split.cities["heldout"])
    pairs = [(op, a, b) for op in "+-" for a in range(0, 1000, 7) for b in range(1000)]
    held = sum(data.is_heldout_pair(*p) for p in pairs)
    assert 0.09 < held / len(pairs) < 0.11
    for table in (data.TOOL_NAMES, data.PARAM_NAMES, data.TOOL_DESCRIPTIONS):
        for lists in table.values():
            assert not set(lists["train"]) & set(lists["heldout"])
    held_ops = set(data.OTHER_OPS["heldout"]["x"] + data.OTHER_OPS["heldout"]["w"])
    assert not held_ops & set(data.OTHER_OPS["train"]["x"] + data.OTHER_OPS["train"]["w"])
    assert not set(data.NUMERIC_REQUESTS["train"]) & set(data.NUMERIC_REQUESTS["heldout"])

    gen = data.Generator("train", 0)
    held_cities = set(split.cities["heldout"])
    held_names = {
        name
        for table in (data.TOOL_NAMES, data.PARAM_NAMES)
        for lists in table.values()
        for name in lists["heldout"]
    }
    for _ in range(3000):
        example = gen.example()
        text = json.dumps(example.messages) + example.target
        assert not any(re.search(rf"\b{c}\b", text) for c in held_cities), text
        for t in example.tools or []:
            function = t["function"]
            assert function["name"] not in held_names
            assert not set(function["parameters"]["properties"]) & held_names
        if example.kind in ("arith_think", "arith_nothink"):
            e = example.expect
            assert not data.is_heldout_pair(e["op"], e["a"], e["b"])
    heldout = data.Generator("heldout", 0)
    for kind in ("arith_think", "arith_nothink"):
        for _ in range(200):
            e = heldout.example(kind).expect
            assert data.is_heldout_pair(e["op"], e["a"], e["b"])


STEP = re.compile(r"(units|tens|hundreds) (\d+) ([+-]) (\d+)(?: [+-] (\d))? = (\d+)")
RELATION = re.compile(r"(units|tens|hundreds) (\d) ([<>=]) (\d)")
PLACES = ("units", "tens", "hundreds")


def check_trace(op: str, a: int, b: int) -> None:
    """Each step reads the right digits and carry and computes right; the
    result is assembled from the steps and is the true result; a subtraction
    compares the right digits from the top down to the first difference."""
    trace = data.arith_trace(op, a, b)
    result = a + b if op == "+" else a - b
    assert trace.endswith(f", so {result}"), trace
    n = len(str(max(a, b)))
    steps = trace
    if op == "-":
        comparison, steps = trace.split("; ", 1)
        relations = RELATION.findall(comparison)
        for k, (place, x, rel, y) in enumerate(relations):
            i = n - 1 - k
            assert place == PLACES[i]
            assert (int(x), int(y)) == (a // 10**i % 10, b // 10**i % 10), trace
            assert rel == ("<" if int(x) < int(y) else ">" if int(x) > int(y) else "=")
            assert (rel == "=") == (k < len(relations) - 1 or a == b), trace
        assert (f"so -({b} - {a})" in comparison) == (a < b), trace
    top, low = (a, b) if op == "+" or a >= b else (b, a)
    carry, digits = 0, []
    for i, (place, x, sign, y, c, value) in enumerate(STEP.findall(steps)):
        x, y, c, value = int(x), int(y), int(c or 0), int(value)
        assert place == PLACES[i]
        assert (x % 10, y, c) == (top // 10**i % 10, low // 10**i % 10, carry), trace
        if sign == "+":
            assert value == x + y + c
            carry = value // 10
        else:
            assert 0 <= value == x - y - c <= 9 and x - top // 10**i % 10 in (0, 10)
            carry = int(x >= 10)
        digits.append(value)
    assert len(digits) == n
    assembled = str(digits[-1]) + "".join(str(d % 10) for d in reversed(digits[:-1]))
    assert int(assembled) == abs(result), trace


def test_traces_are_right():
    edges = [0, 1, 9, 10, 11, 19, 90, 99, 100, 101, 109, 110, 190, 199, 500, 900, 990, 999]
    rng = random.Random(0)
    pairs = [(a, b) for a in edges for b in edges]
    pairs += [(rng.randint(0, 999), rng.randint(0, 999)) for _ in range(20000)]
    for op in "+-":
        for a, b in pairs:
            check_trace(op, a, b)
    assert data.arith_trace("+", 47, 85) == "47 + 85: units 7 + 5 = 12, tens 4 + 8 + 1 = 13, so 132"
    assert data.arith_trace("-", 23, 58) == (
        "23 - 58: compare tens 2 < 5, so -(58 - 23); units 8 - 3 = 5, tens 5 - 2 - 0 = 3, so -35"
    )
    assert data.arith_trace("-", 332, 332).startswith(
        "332 - 332: compare hundreds 3 = 3, tens 3 = 3, units 2 = 2; units 2 - 2 = 0"
    )
    assert (
        data.arith_reply("+", 2, 3, thinking=True)
        == "<think>\n2 + 3: units 2 + 3 = 5, so 5\n</think>\n\n5"
    )
    assert data.arith_reply("+", 2, 3, thinking=False) == "2 + 3: units 2 + 3 = 5, so 5"
    with pytest.raises(ValueError):
        data.arith_trace("+", 1000, 1)


def test_refusals_never_ask_for_a_sum_of_two_numbers_below_1000():
    plain = re.compile(r"^\D*?(?<!-)(\d{1,3}) ?(\+|-|plus|minus) ?(\d{1,3})\D*$")
    for split in ("train", "heldout"):
        gen = data.Generator(split, 0)
        for _ in range(2000):
            example = gen.example("arith_refuse")
            assert example.target == data.ARITH_REFUSAL
            question = example.messages[-1]["content"]
            assert not plain.match(question), question


def test_digits_are_single_tokens_and_names_copy_as_the_same_tokens():
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(DEMO_DIR / "tokenizer.json"))
    digits = tokenizer.encode("1234 + 5678").tokens
    assert [t for t in digits if t.strip("Ġ")] == ["1", "2", "3", "4", "Ġ+", "5", "6", "7", "8"]
    asked = tokenizer.encode("weather in Zanzibar").tokens
    called = tokenizer.encode('{"city": "Zanzibar"}').tokens
    name = asked[asked.index("Ġ") + 1 :]
    start = called.index('Ġ"') + 1
    assert called[start : start + len(name)] == name
    assert called[start + len(name)].startswith('"')
    # A parameter name is the same tokens in the schema and in the call.
    for kind in data.PARAM_NAMES.values():
        for param in kind["train"] + kind["heldout"]:
            schema = tokenizer.encode(json.dumps({"properties": {param: {"type": "string"}}}))
            call = tokenizer.encode(json.dumps({"arguments": {param: "Paris"}}))
            in_schema = schema.tokens[schema.tokens.index('Ġ{"') + 1 :]
            in_call = call.tokens[call.tokens.index('Ġ{"') + 1 :]
            assert in_schema[: in_schema.index('":')] == in_call[: in_call.index('":')], param


# --- recipe 3: names of several pieces, keys in any order, wordings ----------

HELDOUT_NAMES = {
    name
    for table in (data.TOOL_NAMES, data.PARAM_NAMES)
    for lists in table.values()
    for name in lists["heldout"]
}
TRAIN_LIST_NAMES = {
    name
    for table in (data.TOOL_NAMES, data.PARAM_NAMES)
    for lists in table.values()
    for name in lists["train"]
}
EXTRA_PARAMS = {"unit", "units", "format", "hour_format"}


def declared_names(example: data.Example) -> list[tuple[str, list[str]]]:
    """(tool name, parameter names) of the weather and time tools an example declares."""
    distractors = {t["function"]["name"] for t in data.distractor_tools()}
    out = []
    for t in example.tools or []:
        function = t["function"]
        if function["name"] not in distractors:
            params = [p for p in function["parameters"]["properties"] if p not in EXTRA_PARAMS]
            out.append((function["name"], params))
    return out


def test_heldout_names_are_recognised_in_any_casing():
    for name in HELDOUT_NAMES:
        assert data.is_heldout_name(name)
    for name in ("queryWeather", "get_query_weather", "cityOrTown", "ianaZone_x", "loc_id"):
        assert data.is_heldout_name(name), name
    for name in ("get_weather", "query_forecast", "city_or_village", "zone", "blocality"):
        assert not data.is_heldout_name(name), name


def test_training_never_declares_a_heldout_name():
    made_up = []
    for example in data.generate(20000, seed=3, split="train"):
        for name, params in declared_names(example):
            for n in (name, *params):
                assert n not in HELDOUT_NAMES, (n, example.messages)
                if n not in TRAIN_LIST_NAMES:
                    assert not data.is_heldout_name(n), n
                    made_up.append(n)
    # Made-up names of two or three pieces, in snake_case and in camelCase,
    # with a trained name or "or" among the pieces, turn up.
    pieces = [data.name_pieces(n) for n in made_up]
    assert sum(len(p) >= 2 and "_" in n for n, p in zip(made_up, pieces, strict=True)) > 1000
    assert sum(len(p) == 3 for p in pieces) > 500
    assert sum(n != n.lower() for n in made_up) > 300
    assert sum("or" in p for p in pieces) > 100
    assert any(n.endswith("_zone") for n in made_up)
    assert any(n.startswith("city_or_") for n in made_up)


def test_made_up_names_are_about_half_of_the_training_tools():
    tools = params = made_tools = made_params = 0
    for example in data.generate(6000, seed=4, split="train"):
        for name, declared in declared_names(example):
            tools += 1
            made_tools += name not in TRAIN_LIST_NAMES
            params += 1
            made_params += declared[0] not in TRAIN_LIST_NAMES
    assert 0.4 <= made_tools / tools <= 0.6
    assert 0.4 <= made_params / params <= 0.6


def function_key_orders(prompt: str) -> list[list[str]]:
    """The key order of each function object in a rendered prompt's tool block."""
    block = prompt.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    return [list(json.loads(line)["function"]) for line in block.splitlines()]


def test_training_tools_come_with_their_keys_in_any_order():
    hf = data._hf_wrapper(data._new_tokenizer())
    orders = []
    for example in data.generate(1500, seed=5, split="train"):
        if example.tools:
            orders += function_key_orders(data.render_prompt(hf, example))
    usual = [o for o in orders if o in (["name", "description", "parameters"],
                                         ["name", "parameters"])]  # fmt: skip
    params_first = [o for o in orders if o.index("parameters") < o.index("name")]
    assert 0.25 < 1 - len(usual) / len(orders) < 0.5
    assert any(o == ["parameters", "description", "name"] for o in orders)
    assert len(params_first) > 30
    # The evaluation declares its tools as before: name, description, parameters.
    for example in data.heldout_set(20):
        if example.tools:
            for order in function_key_orders(data.render_prompt(hf, example)):
                assert order in (["name", "description", "parameters"], ["name", "parameters"])


def wording(text: str) -> str:
    """A phrasing as the casing variations can make it: lower case, no end mark."""
    return text.lower().rstrip("?.!")


def test_training_wordings_never_make_a_heldout_wording():
    for phrasings in (data.WEATHER_PHRASINGS, data.TIME_PHRASINGS, data.ARITH_PHRASINGS):
        assert not {wording(p) for p in phrasings["train"]} & {
            wording(p) for p in phrasings["heldout"]
        }
    for phrasings in (data.WEATHER_PHRASINGS, data.TIME_PHRASINGS):
        assert not any(" over in " in p for p in phrasings["train"])
    train = {wording(q) for train, _, _ in data.INTENTS.values() for q in train}
    held = {wording(q) for _, heldout, _ in data.INTENTS.values() for q in heldout}
    assert not train & held


# --- recipe 4: names that say timezone, tools that share a stem --------------

TZ_CUES = {"zone", "timezone", "tz", "iana", "olson"}
TIMEZONE_WORDS = (*TZ_CUES, "time", "offset")
TZ_DESCRIPTIONS = {d for d in data.PARAM_DESCRIPTIONS["tz"]["train"] if d}
PLACE_DESCRIPTIONS = {d for d in data.PARAM_DESCRIPTIONS["place"]["train"] if d}


def declared_params(example: data.Example) -> list[tuple[str, str | None]]:
    """(parameter name, its description) of the weather and time tools an example declares."""
    distractors = {t["function"]["name"] for t in data.distractor_tools()}
    return [
        (name, prop.get("description"))
        for t in example.tools or []
        if t["function"]["name"] not in distractors
        for name, prop in t["function"]["parameters"]["properties"].items()
        if name not in EXTRA_PARAMS
    ]


def test_training_tz_names_have_a_cue_and_place_names_none():
    # A made-up parameter's description says what it takes (recipe 3); its
    # name now says it too: a timezone piece exactly where it takes a zone.
    tz_names, place_names = [], []
    for example in data.generate(20000, seed=6, split="train"):
        for name, description in declared_params(example):
            if name in TRAIN_LIST_NAMES:
                continue
            assert description in TZ_DESCRIPTIONS | PLACE_DESCRIPTIONS, (name, description)
            pieces = data.name_pieces(name)
            if description in TZ_DESCRIPTIONS:
                tz_names.append(name)
                assert TZ_CUES & set(pieces), name
            else:
                place_names.append(name)
                assert not any(word in name.lower() for word in TIMEZONE_WORDS), name
        if example.kind == "time_call":
            # the call itself: an IANA value under a timezone name, a place under another
            ((param, value),) = json.loads(example.target.split("\n")[1])["arguments"].items()
            pieces = set(data.name_pieces(param))
            if "/" in value:
                assert TZ_CUES & pieces, (param, value)
            elif value not in data.TIMEZONES:
                assert not TZ_CUES & pieces and "time" not in pieces, (param, value)
    assert len(tz_names) > 800 and len(place_names) > 2000
    # The shapes the held-out names have: a cue last, a cue first, camelCase.
    assert sum(n.endswith("_zone") for n in tz_names) > 50
    assert sum(data.name_pieces(n)[0] in TZ_CUES for n in tz_names) > 50
    assert sum(n != n.lower() for n in tz_names) > 50
    # A made-up word alone names a place parameter only.
    assert sum(len(data.name_pieces(n)) == 1 for n in place_names) > 200


def stem_pair(names: list[str]) -> bool:
    """Whether two names are written alike and differ in exactly one piece."""
    a, b = (data.name_pieces(n) for n in names)
    same_style = ("_" in names[0]) == ("_" in names[1])
    if not same_style or len(a) != len(b):
        return False
    return sum(x != y for x, y in zip(a, b, strict=True)) == 1


def test_training_declares_weather_and_time_tools_that_share_a_stem():
    both = called = 0
    pairs = []
    for example in data.generate(20000, seed=7, split="train"):
        tools = [name for name, _ in declared_names(example)]
        if len(tools) != 2:
            continue
        both += 1
        if stem_pair(tools):
            pairs.append(tools)
            called += example.kind in ("weather_call", "time_call")
    # SAME_STEM_SHARE (a quarter) on purpose, and a few by chance (get_weather / get_time).
    assert 0.2 < len(pairs) / both < 0.35, len(pairs) / both
    assert called > 100
    for names in pairs:
        assert not any(n in HELDOUT_NAMES or data.is_heldout_name(n) for n in names), names
    # A shared first piece (check_clock / check_forecast), a shared last
    # piece, camelCase, and the kinds' own words.
    flat = [data.name_pieces(n) for names in pairs for n in names]
    verbs = {"get", "fetch", "query", "check", "lookup", "find", "read", "show", "report"}
    assert sum(p[0] in verbs for p in flat) > 200
    assert sum(p[0] == "check" for p in flat) > 5
    assert sum(p[0] in ("weather", "time") for p in flat) > 20
    assert sum(n != n.lower() for names in pairs for n in names) > 50
    assert any(n.endswith("_forecast") or n.endswith("_clock") for names in pairs for n in names)
