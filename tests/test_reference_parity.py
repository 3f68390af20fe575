"""Parity with the reference ``mlx_lm.server`` (mlx-lm 0.32.2) on the tiny model.

Starts both servers on the session's tiny random Qwen3 and sends each the
same greedy requests (temperature 0, ``max_tokens`` <= 24). Where we promise
to agree, the test asserts equality; where we deliberately differ, a comment
on the case says how, and the test asserts our side only (the reference's
side is shown, not required).

The model's weights are random, so outputs are gibberish, but greedy
decoding makes them deterministic: the prompts below were chosen for what
their output exercises (an end-of-sequence stop, a ``<think>`` in the output,
a first token with a leading space, ...). Every comparison is made twice,
non-streaming and streaming, where the endpoint streams.

Sync tests: both servers run in their own processes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests import conftest

pytestmark = pytest.mark.server  # starts mlx_lm.server and our server as subprocesses

TIMEOUT = 60
GET_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}


# ------------------------------------------------------------------ servers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One running server process and the requests the tests send it."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], port: int, log: Path):
        self.name = name
        self.base = f"http://127.0.0.1:{port}"
        self.log = log
        # A file, not a pipe: the reference logs every request and would block
        # on a full pipe nobody reads.
        self._log_file = open(log, "wb")  # closed in stop()
        self.proc = subprocess.Popen(argv, env=env, stdout=self._log_file, stderr=subprocess.STDOUT)
        self.client = httpx.Client(base_url=self.base, timeout=TIMEOUT)

    def wait_healthy(self, deadline: float) -> None:
        if not conftest.wait_healthy(self.base, [self.proc], deadline - time.monotonic()):
            self.stop()
            tail = self.log.read_text(errors="replace")[-3000:]
            pytest.fail(f"{self.name} server did not become healthy:\n{tail}")

    def stop(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        self._log_file.close()

    def post(self, path: str, body: dict) -> dict:
        r = self.client.post(path, json=body)
        assert r.status_code == 200, (self.name, body, r.text)
        return r.json()

    def stream(self, path: str, body: dict) -> list:
        """The SSE ``data:`` payloads, parsed; ``[DONE]`` kept as the string."""
        frames = []
        with self.client.stream("POST", path, json={**body, "stream": True}) as r:
            assert r.status_code == 200, (self.name, body, r.read())
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line.removeprefix("data: ")
                    frames.append(data if data == "[DONE]" else json.loads(data))
        return frames


@pytest.fixture(scope="module")
def servers(tiny_model_path, tmp_path_factory):
    """(ours, reference), started side by side on the same model."""
    logs = tmp_path_factory.mktemp("parity-logs")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    ours_port, ref_port = _free_port(), _free_port()
    ours = Server(
        "ours",
        [
            sys.executable,
            "-m",
            "hypercorn",
            "api:app",
            "--worker-class",
            "trio",
            "--bind",
            f"127.0.0.1:{ours_port}",
        ],
        {**env, "MLX_TRIO_MODEL": tiny_model_path},
        ours_port,
        logs / "ours.log",
    )
    ref = Server(
        "reference",
        [
            sys.executable,
            "-m",
            "mlx_lm",
            "server",
            "--model",
            tiny_model_path,
            "--host",
            "127.0.0.1",
            "--port",
            str(ref_port),
            "--log-level",
            "WARNING",
        ],
        env,
        ref_port,
        logs / "reference.log",
    )
    try:
        deadline = time.monotonic() + 90
        ours.wait_healthy(deadline)
        # The reference answers /health as soon as its generation thread is
        # alive, possibly before the model is loaded; the first request then
        # waits for the load (within TIMEOUT).
        ref.wait_healthy(deadline)
        yield ours, ref
    finally:
        ours.stop()
        ref.stop()


def both(servers, call: str, path: str, body: dict):
    """The same request to both servers at once: (ours, reference)."""
    ours, ref = servers
    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(getattr(ours, call), path, body)
        b = pool.submit(getattr(ref, call), path, body)
        return a.result(), b.result()


# ------------------------------------------------------------------ helpers


def chat_body(content: str, **fields) -> dict:
    return {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 24,
        "temperature": 0,
        **fields,
    }


def text_body(prompt: str, **fields) -> dict:
    return {"prompt": prompt, "max_tokens": 24, "temperature": 0, **fields}


def chat_out(resp: dict) -> dict:
    """What a non-streaming chat response says, in comparable form."""
    choice = resp["choices"][0]
    message = choice["message"]
    return {
        "content": message.get("content") or "",
        "reasoning": message.get("reasoning") or "",
        "tool_calls": message.get("tool_calls") or [],
        "finish_reason": choice["finish_reason"],
        "prompt_tokens": resp["usage"]["prompt_tokens"],
        "completion_tokens": resp["usage"]["completion_tokens"],
    }


def chat_stream_out(frames: list) -> dict:
    """The same, joined from a chat stream (sent with include_usage)."""
    content = reasoning = ""
    finish_reason = usage = None
    for frame in frames:
        if frame == "[DONE]":
            continue
        if frame.get("usage"):
            usage = frame["usage"]
        for choice in frame["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning") or ""
            finish_reason = choice["finish_reason"] or finish_reason
    assert usage is not None, frames
    return {
        "content": content,
        "reasoning": reasoning,
        "tool_calls": [],
        "finish_reason": finish_reason,
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": usage["completion_tokens"],
    }


def text_out(resp: dict) -> dict:
    choice = resp["choices"][0]
    return {
        "text": choice["text"],
        "finish_reason": choice["finish_reason"],
        "prompt_tokens": resp["usage"]["prompt_tokens"],
        "completion_tokens": resp["usage"]["completion_tokens"],
    }


def text_stream_out(frames: list) -> dict:
    text = ""
    finish_reason = usage = None
    for frame in frames:
        if frame == "[DONE]":
            continue
        if frame.get("usage"):
            usage = frame["usage"]
        for choice in frame["choices"]:
            text += choice["text"]
            finish_reason = choice["finish_reason"] or finish_reason
    assert usage is not None, frames
    return {
        "text": text,
        "finish_reason": finish_reason,
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": usage["completion_tokens"],
    }


WITH_USAGE = {"stream_options": {"include_usage": True}}


def compare_chat(servers, body: dict) -> dict:
    """Asserts both servers answer ``body`` alike, streaming or not; returns ours."""
    ours, ref = (chat_out(r) for r in both(servers, "post", "/v1/chat/completions", body))
    assert ours == ref, ("non-streaming", body)
    s_ours, s_ref = (
        chat_stream_out(f)
        for f in both(servers, "stream", "/v1/chat/completions", {**body, **WITH_USAGE})
    )
    assert s_ours == ours, ("ours: streaming differs from non-streaming", body)
    assert s_ref == ref, ("reference: streaming differs from non-streaming", body)
    return ours


# ------------------------------------------------------------------ 1. chat


@pytest.mark.parametrize(
    "content, finish_reason",
    [
        ("hello", "length"),
        ("What is the weather in Paris?", "length"),
        # Greedy output: 11 tokens, then <think> and the end-of-sequence token.
        ("in on time by Paris", "stop"),
    ],
)
def test_chat_text_finish_reason_and_usage(servers, content, finish_reason):
    out = compare_chat(servers, chat_body(content))
    assert out["finish_reason"] == finish_reason
    assert out["content"]
    if finish_reason == "length":
        assert out["completion_tokens"] == 24


@pytest.mark.parametrize(
    "content, fields",
    [("hello", {}), ("hello", {"stop": " as as"}), ("in on time by Paris", {})],
    ids=["length", "stop-string", "eos"],
)
def test_seeded_greedy_request(servers, content, fields):
    # A seed takes the reference off its batch onto its sequential path
    # (stream_generate, token-level stop matcher); ours keeps it batched. Under
    # greedy decoding the seed changes nothing: the outputs still agree.
    compare_chat(servers, chat_body(content, seed=7, **fields))


def test_chat_max_completion_tokens_overrides_max_tokens(servers):
    out = compare_chat(servers, chat_body("hello", max_completion_tokens=5))
    assert out["completion_tokens"] == 5


# ------------------------------------------------------ 2. text completions


@pytest.mark.parametrize(
    "prompt",
    [
        "The weather in Paris is",
        # The raw output contains "</think>": outside a thinking block the
        # reference's text state machine passes it through, like ours.
        "Hello, Alice!",
        # The first generated token is " wind", with a leading space.
        "you",
    ],
)
def test_text_completion(servers, prompt):
    # DELIBERATE DIFFERENCE (leading space): the reference's BPE streaming
    # detokenizer drops the completion's first leading space (" wind..."
    # comes back as "wind..."). That is right for a chat reply but wrong for a
    # raw completion, whose text should continue the prompt verbatim. Ours
    # may keep it, so our text is compared after dropping one leading space.
    # (Today ours still drops it too, through the same mlx-lm detokenizer.)
    body = text_body(prompt)
    ours, ref = (text_out(r) for r in both(servers, "post", "/v1/completions", body))
    s_ours, s_ref = (
        text_stream_out(f)
        for f in both(servers, "stream", "/v1/completions", {**body, **WITH_USAGE})
    )
    assert s_ours == ours and s_ref == ref
    assert not ref["text"].startswith(" ")
    normalised = {**ours, "text": ours["text"].removeprefix(" ")}
    assert normalised == ref
    assert ours["text"] in (ref["text"], " " + ref["text"])


def test_text_completion_is_not_parsed_for_tool_calls_or_reasoning(servers):
    # DELIBERATE DIFFERENCE (markup in raw completions): the reference runs
    # the chat text state machine (reasoning / tool-call splitting) over
    # /v1/completions output too, and a text completion has nowhere to put
    # what it splits off: from the first "<tool_call>" (or "<think>") on, its
    # text is silently lost, while usage still counts those tokens. Ours
    # returns a raw completion raw.
    #   request: {"prompt": "on is", "max_tokens": 24, "temperature": 0}
    #   ours:      "\ufffdDaveo\ufffd= Alice Eve<tool_call> wind Rome w\x17 asked..."
    #   reference: "\ufffdDaveo\ufffd= Alice Eve"
    body = text_body("on is")
    ours, ref = (text_out(r) for r in both(servers, "post", "/v1/completions", body))
    assert "<tool_call>" in ours["text"]
    cut = ours["text"].index("<tool_call>")
    assert ref["text"] == ours["text"][:cut]  # shown: the reference loses the rest
    assert ours["completion_tokens"] == ref["completion_tokens"] == 24
    assert ours["finish_reason"] == ref["finish_reason"] == "length"
    assert text_stream_out(servers[0].stream("/v1/completions", {**body, **WITH_USAGE})) == ours


# ------------------------------------------------------------------ 3. stop


# Greedy tokens of chat "hello": "w" "gh" <byte> " Paris" <byte> "unday" " as"
# " as" " as" "It" "N" <byte> "44" "ame" "si" <byte> "It" "," "nt" "Trent" ...
@pytest.mark.parametrize(
    "stop, completion_tokens",
    [
        (" as as", 8),  # two whole tokens
        ("Trent", 20),  # one whole token
        ("It,", 18),  # two whole tokens, the first also seen earlier alone
        (["nope", "Trent", " as as"], 8),  # the first to complete wins
    ],
)
def test_stop_string_on_token_boundaries(servers, stop, completion_tokens):
    out = compare_chat(servers, chat_body("hello", stop=stop))
    assert out["finish_reason"] == "stop"
    assert out["completion_tokens"] == completion_tokens
    stops = [stop] if isinstance(stop, str) else stop
    assert not any(s in out["content"] for s in stops)


def test_stop_string_on_token_boundaries_text_completion(servers):
    # "The weather in Paris is" -> "unit" "nt" "nt" "nt" <byte> "unit" "#" " rain" ...
    body = text_body("The weather in Paris is", stop="# rain")
    ours, ref = (text_out(r) for r in both(servers, "post", "/v1/completions", body))
    assert ours == ref
    assert ours["finish_reason"] == "stop"
    assert ours["text"].endswith("unit")


def test_stop_string_starting_inside_a_token(servers):
    # DELIBERATE DIFFERENCE (stop strings are text, not tokens): "Paris" starts
    # inside the token " Paris". Ours matches stop strings on the decoded text
    # and stops there. The reference matches stop sequences on token ids, so
    # it does not stop; its text state machine still cuts "Paris" out of the
    # text and it runs on to max_tokens:
    #   request: chat "hello", {"stop": "Paris", "max_tokens": 24, "temperature": 0}
    #   ours:      "wgh\ufffd ", finish_reason "stop", completion_tokens 4
    #   reference: "wgh\ufffd \ufffdunday as as asItN...", finish_reason "length", 24
    # Same for "as asIt" (starts after the space of " as") and "ames" (ends
    # inside "si"). Only ours is asserted; the reference's is shown.
    ours, ref = (
        chat_out(r)
        for r in both(servers, "post", "/v1/chat/completions", chat_body("hello", stop="Paris"))
    )
    assert ours["finish_reason"] == "stop"
    assert ours["completion_tokens"] == 4
    assert ours["content"] == "wgh\ufffd "
    s_ours = chat_stream_out(
        servers[0].stream(
            "/v1/chat/completions", {**chat_body("hello", stop="Paris"), **WITH_USAGE}
        )
    )
    assert s_ours == ours
    print("reference, stop inside a token:", ref)


def test_stop_after_an_incomplete_utf8_token(servers):
    # Deliberate difference. Greedy tokens of chat "hello": ... " Paris" <byte>
    # "unday": the byte before "unday" is not valid UTF-8 alone, so the streaming
    # detokenizer holds it until the next token. With stop "unday":
    #   ours:      "wgh\ufffd Paris\ufffd"  (what the tokens before the stop decode to)
    #   reference: "wgh\ufffd Paris"        (at a stop it discards the held text)
    body = chat_body("hello", stop="unday")
    ours, ref = (chat_out(r) for r in both(servers, "post", "/v1/chat/completions", body))
    assert ours["content"] == "wgh\ufffd Paris\ufffd"
    assert ours["finish_reason"] == ref["finish_reason"] == "stop"
    assert ours["content"] == ref["content"] + "\ufffd"


# ------------------------------------------------- 4. penalties, logit_bias


@pytest.fixture(scope="module")
def hello_first_tokens(servers):
    """The reference's ids for chat "hello": (sampled first token, runner-up)."""
    _, ref = servers
    resp = ref.post(
        "/v1/chat/completions", chat_body("hello", max_tokens=1, logprobs=True, top_logprobs=2)
    )
    top = resp["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    top = sorted(top, key=lambda e: -e["logprob"])  # the reference's are unsorted
    return top[0]["id"], top[1]["id"]


@pytest.mark.parametrize(
    "fields",
    [
        {"repetition_penalty": 1.3},
        {"presence_penalty": 0.5},
        {"frequency_penalty": 0.5},
        {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.5},
        {"logit_bias": "ban-first"},
        {"logit_bias": "boost-runner-up"},
    ],
    ids=["repetition", "presence", "frequency", "all-three", "bias-100", "bias+5"],
)
def test_penalties_and_logit_bias(servers, hello_first_tokens, fields):
    first, runner_up = hello_first_tokens
    if fields.get("logit_bias") == "ban-first":
        fields = {"logit_bias": {str(first): -100}}
    elif fields.get("logit_bias") == "boost-runner-up":
        fields = {"logit_bias": {str(runner_up): 5.0}}
    plain = servers[0].post("/v1/chat/completions", chat_body("hello"))
    out = compare_chat(servers, chat_body("hello", **fields))
    # The field took effect (else equality would prove nothing).
    assert out["content"] != plain["choices"][0]["message"]["content"]


# --------------------------------------------------------------- 5. logprobs


def test_logprobs_of_the_sampled_token(servers, tiny_tokenizer):
    # DELIBERATE DIFFERENCE (shape): the reference's entries are
    # {"id", "logprob"} (no "token", "bytes" or "top_logprobs"); ours are
    # OpenAI's {"token", "logprob", "bytes", "top_logprobs": []} with the same "id".
    body = chat_body("hello", logprobs=True)
    ours, ref = both(servers, "post", "/v1/chat/completions", body)
    assert chat_out(ours) == chat_out(ref)
    o = ours["choices"][0]["logprobs"]["content"]
    r = ref["choices"][0]["logprobs"]["content"]
    assert len(o) == len(r) == 24
    for mine, theirs in zip(o, r, strict=True):
        assert set(theirs) == {"id", "logprob"}
        assert set(mine) == {"id", "token", "logprob", "bytes", "top_logprobs"}
        assert mine["id"] == theirs["id"]
        assert mine["token"] == tiny_tokenizer.decode([theirs["id"]])
        assert mine["bytes"] == list(mine["token"].encode())
        assert mine["top_logprobs"] == []
        assert mine["logprob"] == pytest.approx(theirs["logprob"], abs=1e-4)


def test_top_logprobs(servers):
    # DELIBERATE DIFFERENCE (reference bug): with top_logprobs > 1 the
    # reference builds each entry from the first element of an *unsorted*
    # argpartition of the top list, so the entry's "id"/"token"/"logprob" are
    # often not the sampled token's (for chat "hello", token 2 was sampled as
    # "gh" at -0.034 but the entry says "W" at -4.19), and its top list is not
    # sorted. So only our own consistency is asserted: the entry is the
    # sampled token, it appears in our top list with the same logprob, and the
    # list is sorted, descending. The top lists hold the same alternatives on
    # both sides: their logprob values agree once sorted.
    body = chat_body("hello", logprobs=True, top_logprobs=3)
    ours, ref = both(servers, "post", "/v1/chat/completions", body)
    assert chat_out(ours) == chat_out(ref)
    plain = servers[0].post("/v1/chat/completions", chat_body("hello", logprobs=True))
    sampled = plain["choices"][0]["logprobs"]["content"]
    o = ours["choices"][0]["logprobs"]["content"]
    r = ref["choices"][0]["logprobs"]["content"]
    assert len(o) == len(r) == len(sampled) == 24
    for mine, theirs, alone in zip(o, r, sampled, strict=True):
        assert mine["token"] == alone["token"]
        assert mine["logprob"] == pytest.approx(alone["logprob"], abs=1e-5)
        top = mine["top_logprobs"]
        assert len(top) == 3
        values = [e["logprob"] for e in top]
        assert values == sorted(values, reverse=True)
        assert mine["logprob"] in [e["logprob"] for e in top if e["token"] == mine["token"]]
        assert mine["logprob"] == pytest.approx(values[0], abs=1e-6)  # greedy: the top one
        theirs_values = sorted((e["logprob"] for e in theirs["top_logprobs"]), reverse=True)
        assert values == pytest.approx(theirs_values, abs=1e-4)


# ------------------------------------------------------------------ 6. tools


def test_tools_render_into_the_same_prompt(servers):
    # Random weights do not make a well-formed tool call, so what is compared
    # is the prompt: equal prompt_tokens (several hundred with the tool
    # schema) show both rendered the tools into the template alike; and the
    # generated text and finish_reason.
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the weather in Paris?"},
    ]
    plain = {"messages": messages, "max_tokens": 24, "temperature": 0}
    without = compare_chat(servers, plain)
    with_tools = compare_chat(servers, {**plain, "tools": [GET_WEATHER]})
    assert with_tools["prompt_tokens"] > without["prompt_tokens"] + 100


def test_unparsable_tool_call_block(servers):
    # DELIBERATE DIFFERENCE (docs/api.md: "A tool-call block that fails to
    # parse is returned in content as text"): the greedy output of chat
    # "Rome me helpful" opens "<tool_call>" after 11 tokens and never closes
    # it. The reference hands the block to the tool parser at the end, which
    # fails; it logs a warning and drops the text. Ours returns the block's
    # text (without the "<tool_call>" marker) in content:
    #   ours:      "ghcelsius\ufffd\ufffd#\ufffd\x04MaMaMaunZ\nnownow...Ma\ufffd"
    #   reference: "ghcelsius\ufffd\ufffd#\ufffd\x04MaMaMaun"
    # Both: finish_reason "length", 24 tokens, no tool_calls.
    # (No tools in the request: that would change the prompt; the markup is
    # split and parsed either way.)
    body = chat_body("Rome me helpful")
    ours, ref = (chat_out(r) for r in both(servers, "post", "/v1/chat/completions", body))
    assert ours["tool_calls"] == ref["tool_calls"] == []
    assert ours["finish_reason"] == ref["finish_reason"] == "length"
    assert ours["prompt_tokens"] == ref["prompt_tokens"]
    assert ours["completion_tokens"] == ref["completion_tokens"] == 24
    assert ours["content"].startswith(ref["content"])
    assert len(ours["content"]) > len(ref["content"])
    assert "<tool_call>" not in ours["content"]
    s_ours = chat_stream_out(servers[0].stream("/v1/chat/completions", {**body, **WITH_USAGE}))
    assert s_ours == ours


# -------------------------------------------------------------- 7. reasoning


def test_enable_thinking_template_kwarg(servers):
    # The template closes an empty <think></think> block when enable_thinking
    # is false; both servers must pass chat_template_kwargs to the template.
    body = chat_body("What is the weather in Paris?")
    default = compare_chat(servers, body)
    thinking = compare_chat(servers, {**body, "chat_template_kwargs": {"enable_thinking": True}})
    off = compare_chat(servers, {**body, "chat_template_kwargs": {"enable_thinking": False}})
    assert thinking["prompt_tokens"] == default["prompt_tokens"]
    assert off["prompt_tokens"] > default["prompt_tokens"]


def test_reasoning_split_of_generated_think_block(servers):
    # The greedy output of chat "degrees Let asked" emits "<think>" as its
    # 15th token: the text after it is reasoning on both servers.
    # DELIBERATE DIFFERENCE (extra field): ours also sends the reasoning as
    # "reasoning_content" (the name other OpenAI-compatible servers use); the
    # reference sends "reasoning" only.
    body = chat_body("degrees Let asked")
    out = compare_chat(servers, body)
    assert out["content"] and out["reasoning"]
    assert out["finish_reason"] == "length"
    ours = servers[0].post("/v1/chat/completions", body)["choices"][0]["message"]
    assert ours["reasoning_content"] == ours["reasoning"]


# -------------------------------------------------------------- 8. streaming


def test_streaming_framing(servers):
    ours, ref = servers
    body = chat_body("hello")
    plain = ours.post("/v1/chat/completions", body)["choices"][0]["message"]["content"]

    # Without stream_options: text chunks, a final chunk with finish_reason,
    # then [DONE], on both.
    for frames in both(servers, "stream", "/v1/chat/completions", body):
        assert frames[-1] == "[DONE]"
        chunks = frames[:-1]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert all("usage" not in c for c in chunks)
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == plain
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"

    # DELIBERATE DIFFERENCE (stream_options: {}): the reference reads
    # stream_options["include_usage"], raises KeyError after the final chunk
    # and closes the stream without [DONE]; ours treats a missing
    # include_usage as false and ends with [DONE].
    o, r = both(servers, "stream", "/v1/chat/completions", {**body, "stream_options": {}})
    assert o[-1] == "[DONE]" and all("usage" not in c for c in o[:-1])
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in o[:-1]) == plain
    assert r[-1] != "[DONE]"
    assert all("usage" not in c for c in r)

    # DELIBERATE DIFFERENCE (usage chunk object): with include_usage, the
    # usage chunk of a chat stream is "chat.completion.chunk" in ours, as
    # OpenAI sends it; the reference labels it "chat.completion". For a text
    # completion stream ours says "text_completion", the reference again
    # "chat.completion". The usage itself agrees (compare_chat).
    o, r = both(servers, "stream", "/v1/chat/completions", {**body, **WITH_USAGE})
    assert o[-1] == r[-1] == "[DONE]"
    assert o[-2]["choices"] == r[-2]["choices"] == []
    assert o[-2]["object"] == "chat.completion.chunk"
    assert r[-2]["object"] == "chat.completion"
    assert o[-2]["usage"]["prompt_tokens"] == r[-2]["usage"]["prompt_tokens"]
    assert o[-2]["usage"]["completion_tokens"] == r[-2]["usage"]["completion_tokens"] == 24
    o, r = both(servers, "stream", "/v1/completions", {**text_body("you"), **WITH_USAGE})
    assert o[-2]["object"] == "text_completion"
    assert r[-2]["object"] == "chat.completion"
    for key in ("prompt_tokens", "completion_tokens"):
        assert o[-2]["usage"][key] == r[-2]["usage"][key]
