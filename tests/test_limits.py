"""Limits through real servers: the context window, completions logprobs, n choices.

Each server is a subprocess (``mlx-trio-server`` or ``hypercorn api:app``) on
the tiny random model (context window 2048, vocabulary 512), shared by the
tests of this module. Prompts are token ids on ``/v1/completions`` so their
lengths are exact; ``logit_bias`` against the end-of-sequence tokens keeps a
generation going to its limit.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tests.conftest import raw_chat_request, read_sse_chunks
from tests.test_server_process import hypercorn_args, spawn_server, stop_server

pytestmark = pytest.mark.server  # starts server subprocesses

WINDOW = 2048  # the tiny model's max_position_embeddings (and its tokenizer's limit)


def ids(n: int, step: int = 1) -> list[int]:
    """``n`` prompt token ids, all ordinary tokens of the tiny vocabulary (prompts
    with different ``step`` share no prefix the prompt cache could serve)."""
    return [20 + (i * step) % 400 for i in range(n)]


@pytest.fixture(scope="module")
def never_end(tiny_tokenizer) -> dict[str, float]:
    return {str(e): -100 for e in tiny_tokenizer.eos_token_ids}


@pytest.fixture(scope="module")
def server(tiny_model_path):
    proc, base = spawn_server(
        lambda port: ["-m", "api.cli", "--model", tiny_model_path, "--port", str(port),
                      "--max-choices", "4"]
    )
    yield base
    stop_server(proc)


@pytest.fixture(scope="module")
def short_server(tiny_model_path):
    """The window set by its setting (here the environment variable, under Hypercorn)."""
    env = {"MLX_TRIO_MODEL": tiny_model_path, "MLX_TRIO_MAX_MODEL_LEN": "64"}
    proc, base = spawn_server(hypercorn_args, env)
    yield base
    stop_server(proc)


def complete(base: str, **body) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", json=body, timeout=120)


def chat(base: str, content: str, **body) -> httpx.Response:
    messages = [{"role": "user", "content": content}]
    return httpx.post(
        f"{base}/v1/chat/completions", json={"messages": messages, **body}, timeout=120
    )


def metric(base: str, name: str) -> float:
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


def sse_payloads(raw: str) -> tuple[list[dict], bool]:
    payloads, done = [], False
    for block in raw.split("\n\n"):
        if block.startswith("data: [DONE]"):
            done = True
        elif block.startswith("data: "):
            payloads.append(json.loads(block[6:]))
    return payloads, done


# ------------------------------------------------------------ the context window


def test_models_and_health_report_the_window(server, short_server):
    for base, window in ((server, WINDOW), (short_server, 64)):
        card = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]
        assert card["context_length"] == card["max_model_len"] == window
        assert httpx.get(f"{base}/health", timeout=10).json()["max_model_len"] == window


@pytest.mark.parametrize("window_of", ["model", "setting"])
def test_a_prompt_that_fills_the_window_is_a_400_naming_both_numbers(
    server, short_server, window_of
):
    base, window = (server, WINDOW) if window_of == "model" else (short_server, 64)
    for length in (window, window + 37):
        r = complete(base, prompt=ids(length), max_tokens=4)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "context_length_exceeded"
        assert error["param"] == "prompt"
        assert str(window) in error["message"] and str(length) in error["message"]
    # Chat: the prompt is the templated conversation; the field to blame is messages.
    long_text = " ".join(f"w{i}" for i in range(window))
    r = chat(base, long_text, max_tokens=4)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages"
    assert r.json()["error"]["code"] == "context_length_exceeded"
    # The agent APIs blame their own fields: Responses' input, Anthropic's messages.
    r = httpx.post(f"{base}/v1/responses", json={"input": long_text, "max_output_tokens": 4},
                   timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
    r = httpx.post(
        f"{base}/v1/messages",
        json={"model": "claude-x", "max_tokens": 4,
              "messages": [{"role": "user", "content": long_text}]},
        timeout=120,
    )
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and "messages" in r.json()["error"]["message"]


def test_max_tokens_past_the_window_is_served_up_to_the_window(server, never_end):
    # The last free position: one token, ended by the window.
    body = complete(server, prompt=ids(WINDOW - 1), max_tokens=50, logit_bias=never_end).json()
    assert body["usage"]["completion_tokens"] == 1
    assert body["choices"][0]["finish_reason"] == "length"
    # A huge max_tokens (clients send them) is no 413: the window bounds it.
    for max_tokens in (10**7, 10**9):
        r = complete(server, prompt=ids(WINDOW - 6), max_tokens=max_tokens, logit_bias=never_end)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == WINDOW
        assert r.json()["choices"][0]["finish_reason"] == "length"


def test_streamed_and_chat_answers_end_at_the_window_too(short_server, never_end):
    r = chat(short_server, "hi", max_tokens=10**9, logit_bias=never_end)
    assert r.status_code == 200
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 64
    with httpx.stream("POST", f"{short_server}/v1/completions", timeout=60, json={
        "prompt": ids(60), "max_tokens": 10**9, "stream": True, "logit_bias": never_end,
        "stream_options": {"include_usage": True},
    }) as s:
        payloads, done = sse_payloads(s.read().decode())
    assert done
    assert payloads[-2]["choices"][0]["finish_reason"] == "length"
    assert payloads[-1]["usage"]["completion_tokens"] == 4


# ----------------------------------------------------------- completions logprobs


def test_completions_logprobs_integer_is_the_legacy_shape(server):
    body = complete(server, prompt="the weather in Paris", max_tokens=5, logprobs=3).json()
    lp = body["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset", "token_ids"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    assert "".join(lp["tokens"]) == body["choices"][0]["text"]
    # The same (greedy) request in chat's shape lists the 3 most likely as a list.
    content = complete(server, prompt="the weather in Paris", max_tokens=5, logprobs=True,
                       top_logprobs=3).json()["choices"][0]["logprobs"]["content"]
    for token, logprob, top, entry in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"],
                                          content, strict=True):
        # The 3 most likely, and always the sampled token (keys are texts: the tiny
        # tokenizer's partial UTF-8 pieces all read "\ufffd", so some share one).
        assert set(top) == {t["token"] for t in entry["top_logprobs"]} | {token}
        assert logprob == entry["logprob"] <= top[token]
        assert max(top.values()) == entry["top_logprobs"][0]["logprob"]
    # logprobs: 0 gives the sampled token's alone.
    zero = complete(server, prompt="the weather in Paris", max_tokens=3, logprobs=0).json()
    tops = zero["choices"][0]["logprobs"]["top_logprobs"]
    assert all(len(t) == 1 for t in tops)


def test_completions_logprobs_true_is_mlx_lm_servers_shape(server):
    body = complete(server, prompt="the weather in Paris", max_tokens=4, logprobs=True).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    assert all(isinstance(e["logprob"], float) and e["top_logprobs"] == [] for e in content)
    assert "".join(e["token"] for e in content) == body["choices"][0]["text"]
    top = complete(server, prompt="the weather in Paris", max_tokens=2, logprobs=True,
                   top_logprobs=2).json()
    assert all(len(e["top_logprobs"]) == 2 for e in top["choices"][0]["logprobs"]["content"])
    off = complete(server, prompt="the weather in Paris", max_tokens=2, logprobs=False).json()
    assert off["choices"][0]["logprobs"] is None
    bad = complete(server, prompt="x", max_tokens=2, logprobs=21)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logprobs"


def test_completions_honour_max_completion_tokens(server, never_end):
    body = complete(server, prompt="hello", max_completion_tokens=7, max_tokens=30,
                    logit_bias=never_end).json()
    assert body["usage"]["completion_tokens"] == 7


# ------------------------------------------------------------------ n choices


def test_n_choices_share_one_prefill(server, never_end):
    prompt = ids(300, step=7)
    before = metric(server, "mlx_trio_prompt_tokens_computed_total")
    body = complete(server, prompt=prompt, n=4, max_tokens=6, temperature=1.0, seed=11,
                    logit_bias=never_end).json()
    computed = metric(server, "mlx_trio_prompt_tokens_computed_total") - before
    # Choice 0 computes the prompt; each other choice only its last token.
    assert computed == len(prompt) + 3
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["prompt_tokens"] == len(prompt)
    assert body["usage"]["completion_tokens"] == 4 * 6
    texts = [c["text"] for c in body["choices"]]
    assert len(set(texts)) > 1  # each choice is sampled on its own (seed + index)
    again = complete(server, prompt=prompt, n=4, max_tokens=6, temperature=1.0, seed=11,
                     logit_bias=never_end).json()
    assert [c["text"] for c in again["choices"]] == texts  # and reproducibly


def test_n_chat_choices_stream_interleaved(server, never_end):
    with httpx.stream("POST", f"{server}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "tell me about cats"}], "n": 3,
        "max_tokens": 8, "temperature": 0.8, "seed": 5, "stream": True,
        "logit_bias": never_end, "stream_options": {"include_usage": True},
    }) as s:
        payloads, done = sse_payloads(s.read().decode())
    assert done
    chunks = [p for p in payloads if p["choices"]]
    assert len({p["id"] for p in payloads}) == 1
    by_index: dict[int, list[dict]] = {}
    for p in chunks:
        (choice,) = p["choices"]
        by_index.setdefault(choice["index"], []).append(choice)
    assert sorted(by_index) == [0, 1, 2]
    order = [p["choices"][0]["index"] for p in chunks]
    assert order != sorted(order)  # interleaved as their tokens come, not one after another
    for choices in by_index.values():
        assert choices[0]["delta"]["role"] == "assistant"
        assert all("role" not in c["delta"] for c in choices[1:])
        assert [c["finish_reason"] for c in choices][-1] == "length"
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 24
    # Not streamed, the same request gives the same three texts.
    body = chat(server, "tell me about cats", n=3, max_tokens=8, temperature=0.8, seed=5,
                logit_bias=never_end).json()
    streamed = ["".join(c["delta"].get("content") or "" for c in by_index[i]) for i in range(3)]
    assert [c["message"]["content"] for c in body["choices"]] == streamed


def test_n_above_the_limit_is_a_400(server):
    r = complete(server, prompt="x", n=5, max_tokens=2)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert "4" in r.json()["error"]["message"]


def test_a_disconnect_cancels_every_choice(server, never_end):
    host, port = server.removeprefix("http://").split(":")
    request = raw_chat_request(host, {
        "messages": [{"role": "user", "content": "a long story"}], "n": 4,
        "max_tokens": 100000, "stream": True, "logit_bias": never_end,
    })
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(request)
        read_sse_chunks(sock, 8)
        assert httpx.get(f"{server}/health", timeout=5).json()["active_sequences"] == 4
    deadline = time.monotonic() + 10
    while True:
        h = httpx.get(f"{server}/health", timeout=5).json()
        if h["active_sequences"] == 0 and h["requests_in_flight"] == 0:
            break
        assert time.monotonic() < deadline, f"choices still running after the disconnect: {h}"
        time.sleep(0.05)
