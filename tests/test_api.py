"""The app end to end through Quart's test client, on a real tiny mlx model."""

from __future__ import annotations

import json

import pytest
import trio
import werkzeug.exceptions

from api.errors import error_answer, error_body
from api.server import create_app
from runtime.config import ServerConfig
from runtime.errors import ClientError, Overloaded, Unavailable
from runtime.messages import Failed
from tests.conftest import wait_ready

CHAT = "/v1/chat/completions"


def chat_body(content="hello there", **extra):
    return {"model": "default_model", "messages": [{"role": "user", "content": content}], **extra}


def parse_sse(raw: bytes) -> tuple[list[dict], list[str], bool]:
    """(data payloads, comment lines, saw [DONE])."""
    payloads, comments, done = [], [], False
    for block in raw.decode().split("\n\n"):
        block = block.strip()
        if not block:
            continue
        if block.startswith(":"):
            comments.append(block)
        elif block == "data: [DONE]":
            done = True
        else:
            assert block.startswith("data: "), block
            assert not done, "data after [DONE]"
            payloads.append(json.loads(block[len("data: ") :]))
    return payloads, comments, done


async def stream_post(client, path, body) -> tuple[int, dict, bytes]:
    """POST and read the body as it streams (the test client buffers only 10 chunks)."""
    headers = {"Content-Type": "application/json"}
    async with client.request(path, method="POST", headers=headers) as conn:
        await conn.send(json.dumps(body).encode())
        await conn.send_complete()
        data = b""
        try:
            while True:
                data += await conn.receive()
        except trio.EndOfChannel:
            pass
    return conn.status_code, conn.headers, data


async def post(client, path, body):
    response = await client.post(path, json=body)
    return response.status_code, await response.get_json(), response


async def test_health_and_models(client):
    response = await client.get("/health")
    body = await response.get_json()
    assert response.status_code == 200
    assert body["status"] == "ok" and body["model_state"] == "ready"
    response = await client.get("/v1/models")
    models = await response.get_json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == client.app.extensions["runtime"].model_id


async def test_chat_completion_shape(client):
    status, body, _ = await post(client, CHAT, chat_body(max_tokens=6))
    assert status == 200, body
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert "content" in choice["message"]
    assert choice["finish_reason"] in ("length", "stop")
    usage = body["usage"]
    assert usage["completion_tokens"] <= 6
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert "cached_tokens" in usage["prompt_tokens_details"]


async def test_greedy_is_deterministic_and_stream_matches(client):
    body = chat_body("what is the weather in Paris", max_tokens=12)
    _, first, _ = await post(client, CHAT, body)
    _, second, _ = await post(client, CHAT, body)
    text = first["choices"][0]["message"]["content"]
    assert text == second["choices"][0]["message"]["content"]

    status, headers, raw = await stream_post(
        client, CHAT, {**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert status == 200
    assert headers["Content-Type"].startswith("text/event-stream")
    payloads, _, done = parse_sse(raw)
    assert done
    streamed = "".join(p["choices"][0]["delta"].get("content", "") for p in payloads if p["choices"])
    assert streamed == (text or "")
    assert all(p["object"] == "chat.completion.chunk" for p in payloads)
    finals = [p for p in payloads if p["choices"] and p["choices"][0]["finish_reason"]]
    assert len(finals) == 1
    usage_chunks = [p for p in payloads if p.get("usage")]
    assert len(usage_chunks) == 1 and usage_chunks[0]["choices"] == []
    assert usage_chunks[0]["usage"]["completion_tokens"] == first["usage"]["completion_tokens"]


async def test_stream_options_without_usage_still_ends_with_done(client):
    _, _, raw = await stream_post(client, CHAT, chat_body(max_tokens=3, stream=True, stream_options={}))
    payloads, _, done = parse_sse(raw)
    assert done
    assert not any(p.get("usage") for p in payloads)


async def test_text_completion_stream_and_not(client):
    body = {"prompt": "the weather in Rome is", "max_tokens": 8}
    status, full, _ = await post(client, "/v1/completions", body)
    assert status == 200 and full["object"] == "text_completion"
    text = full["choices"][0]["text"]
    _, _, raw = await stream_post(client, "/v1/completions", {**body, "stream": True})
    payloads, _, done = parse_sse(raw)
    assert done
    assert "".join(p["choices"][0]["text"] for p in payloads if p["choices"]) == text


def _logprobs_of(payloads: list[dict]) -> list[dict]:
    """The logprobs objects of a body's or a stream's choices, in order."""
    return [
        p["choices"][0]["logprobs"] for p in payloads if p["choices"] and p["choices"][0].get("logprobs")
    ]


def assert_entries_carry_ids(entries: list[dict], tokenizer, top: int) -> None:
    """mlx_lm.server's ``id`` next to OpenAI's fields, on each entry and each alternative."""
    assert entries
    for entry in entries:
        assert set(entry) == {"id", "token", "logprob", "bytes", "top_logprobs"}, entry
        assert type(entry["id"]) is int and tokenizer.decode([entry["id"]]) == entry["token"]
        assert len(entry["top_logprobs"]) == top
        for alternative in entry["top_logprobs"]:
            assert set(alternative) == {"id", "token", "logprob", "bytes"}, alternative
            assert type(alternative["id"]) is int
            assert tokenizer.decode([alternative["id"]]) == alternative["token"]
        if top:  # greedy: the sampled token is the most likely one
            assert entry["top_logprobs"][0]["id"] == entry["id"]


@pytest.mark.parametrize("path", [CHAT, "/v1/completions"])
async def test_logprobs_carry_the_token_id(client, tiny_tokenizer, path):
    """Each logprobs entry and each top_logprobs entry names its token id, streamed or not,
    on both endpoints; the legacy completions shape (``logprobs: N``) has ``token_ids``."""
    base = (chat_body("the weather in Paris") if path == CHAT else {"prompt": "the weather in"})
    base = {**base, "max_tokens": 4, "temperature": 0}
    for fields, top in [({"logprobs": True}, 0), ({"logprobs": True, "top_logprobs": 3}, 3)]:
        status, body, _ = await post(client, path, {**base, **fields})
        assert status == 200, body
        [logprobs] = _logprobs_of([body])
        assert_entries_carry_ids(logprobs["content"], tiny_tokenizer, top)
        _, _, raw = await stream_post(client, path, {**base, **fields, "stream": True})
        payloads, _, done = parse_sse(raw)
        assert done
        streamed = [e for lp in _logprobs_of(payloads) for e in lp["content"]]
        assert_entries_carry_ids(streamed, tiny_tokenizer, top)
        assert streamed == logprobs["content"]
    if path == CHAT:
        return
    status, body, _ = await post(client, path, {**base, "logprobs": 2})
    assert status == 200, body
    [legacy] = _logprobs_of([body])
    assert set(legacy) == {"tokens", "token_logprobs", "top_logprobs", "text_offset", "token_ids"}
    assert len(legacy["token_ids"]) == len(legacy["tokens"]) == 4
    for token_id, token in zip(legacy["token_ids"], legacy["tokens"], strict=True):
        assert type(token_id) is int and tiny_tokenizer.decode([token_id]) == token
    _, _, raw = await stream_post(client, path, {**base, "logprobs": 2, "stream": True})
    payloads, _, done = parse_sse(raw)
    assert done
    streamed = _logprobs_of(payloads)
    assert [i for lp in streamed for i in lp["token_ids"]] == legacy["token_ids"]
    assert [t for lp in streamed for t in lp["tokens"]] == legacy["tokens"]


async def test_stop_string_cuts_text_across_tokens(client):
    for prompt in ["tell me about the time in Tokyo", "weather in Paris", "hello", "3 + 4", "cats"]:
        body = chat_body(prompt, max_tokens=24)
        _, full, _ = await post(client, CHAT, body)
        text = full["choices"][0]["message"]["content"] or ""
        if len(text) >= 6:
            break
    assert len(text) >= 6, "the random model should produce some text for one of these"
    stop = text[3:6]
    expected = text[: text.find(stop)]
    for stream in (False, True):
        if stream:
            _, _, raw = await stream_post(client, CHAT, {**body, "stop": [stop], "stream": True})
            payloads, _, done = parse_sse(raw)
            assert done
            got = "".join(p["choices"][0]["delta"].get("content", "") for p in payloads if p["choices"])
            reason = [p["choices"][0]["finish_reason"] for p in payloads if p["choices"]][-1]
        else:
            _, data, _ = await post(client, CHAT, {**body, "stop": [stop]})
            got = data["choices"][0]["message"]["content"] or ""
            reason = data["choices"][0]["finish_reason"]
        assert got == expected
        assert reason == "stop"


async def test_concurrent_greedy_requests_match_solo(client):
    prompts = [f"request number {i}: say something about {w}" for i, w in enumerate(
        ["cats", "dogs", "Paris", "rain", "seven", "time", "Rome", "snow"] * 2
    )]
    solo = []
    for p in prompts:
        _, body, _ = await post(client, CHAT, chat_body(p, max_tokens=10))
        solo.append(body["choices"][0]["message"]["content"])
    assert len(set(solo)) > 1, "the model should say different things to different prompts"

    together: dict[int, str] = {}

    async def one(i, p):
        _, body, _ = await post(client, CHAT, chat_body(p, max_tokens=10))
        together[i] = body["choices"][0]["message"]["content"]

    async with trio.open_nursery() as nursery:
        for i, p in enumerate(prompts):
            nursery.start_soon(one, i, p)
    assert [together[i] for i in range(len(prompts))] == solo


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": True}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "stop": 123}, "stop"),
        ({"messages": [{"role": "user", "content": "x"}], "stop": [1, 2]}, "stop[0]"),
        ({"messages": [{"role": "user", "content": "x"}], "seed": -1}, "seed"),
        ({"messages": [{"role": "user", "content": "x"}], "top_k": 100000}, "top_k"),
        ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"999999": 5}}, "logit_bias"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": -1}, "temperature"),
        ({"messages": []}, "messages"),
        ({}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0].image_url"),
        ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "messages[0].content[0].type"),
    ],
)
async def test_bad_input_is_a_400_naming_the_field(client, body, param):
    status, data, _ = await post(client, CHAT, body)
    assert status == 400, data
    assert data["error"]["param"] == param
    assert data["error"]["type"] == "invalid_request_error"
    assert data["error"]["message"]
    status, _, _ = await post(client, CHAT, chat_body(max_tokens=2))
    assert status == 200


@pytest.mark.parametrize(
    "raw, content_type",
    [
        (b"{not json", "application/json"),
        (b"[1, 2]", "application/json"),
        (b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', "application/json"),
        (b"\xff\xfe\x00", "application/json"),
        (b'{"messages": [{"role": "user", "content": "x"}]}', "text/plain"),
    ],
)
async def test_bad_bodies(client, raw, content_type):
    response = await client.post(CHAT, data=raw, headers={"Content-Type": content_type})
    data = await response.get_json()
    if content_type == "text/plain":
        assert response.status_code == 200  # a missing or odd Content-Type is tolerated
        return
    assert response.status_code == 400
    assert set(data["error"]) == {"message", "type", "param", "code"}


async def test_unknown_path_and_cors(client):
    response = await client.get("/nope")
    assert response.status_code == 404
    assert (await response.get_json())["error"]["type"] == "not_found_error"
    response = await client.options(CHAT, headers={"Origin": "http://example.com"})
    assert response.status_code == 204
    assert response.headers["Access-Control-Allow-Origin"] == "*"


async def test_seeded_sampling_is_reproducible_inside_the_batch(client):
    body = chat_body("pick a word", max_tokens=12, temperature=1.0, seed=1234)
    _, alone, _ = await post(client, CHAT, body)
    text = alone["choices"][0]["message"]["content"]
    results = {}

    async def one(key, b):
        _, data, _ = await post(client, CHAT, b)
        results[key] = data["choices"][0]["message"]["content"]

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one, "seeded", body)
        for i in range(4):
            nursery.start_soon(one, i, chat_body(f"noise {i}", max_tokens=12, temperature=1.0))
    assert results["seeded"] == text
    others = set()
    for seed in (1, 2, 3):
        _, data, _ = await post(client, CHAT, {**body, "seed": seed})
        others.add(data["choices"][0]["message"]["content"])
    assert others != {text}


async def test_second_turn_reuses_the_first_turns_cache_and_matches_a_cold_server(
    client, tiny_model_path
):
    # Long enough (> 64 tokens) that reusing it beats prefilling it again
    # (the server's --prompt-cache-min-reuse floor).
    system = {"role": "system", "content": "You are a terse assistant who knows the weather. " * 4}
    turn1 = [system, {"role": "user", "content": "what is the weather in Paris"}]
    _, first, _ = await post(client, CHAT, {"messages": turn1, "max_tokens": 8})
    reply = first["choices"][0]["message"]["content"] or ""
    turn2 = turn1 + [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "and in Rome"},
    ]
    _, second, _ = await post(client, CHAT, {"messages": turn2, "max_tokens": 8})
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["prompt_tokens"] - 1  # at least the whole first prompt
    assert cached < second["usage"]["prompt_tokens"]

    cold = create_app(ServerConfig(model=tiny_model_path))
    async with cold.test_app() as test_app:
        cold_client = test_app.test_client()
        await wait_ready(cold_client)
        _, fresh, _ = await post(cold_client, CHAT, {"messages": turn2, "max_tokens": 8})
    assert fresh["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert fresh["choices"][0]["message"]["content"] == second["choices"][0]["message"]["content"]


async def test_a_new_conversation_reuses_the_system_prompt(client):
    system = {"role": "system", "content": "You answer questions about cats and dogs only. " * 4}
    a = [system, {"role": "user", "content": "tell me about cats"}]
    b = [system, {"role": "user", "content": "tell me about dogs please"}]
    await post(client, CHAT, {"messages": a, "max_tokens": 2})
    _, second, _ = await post(client, CHAT, {"messages": b, "max_tokens": 2})
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 64


async def test_a_short_shared_prefix_is_not_reused(client):
    # Only the template's opening and a short system prompt in common: below
    # the 64-token floor, so the second request is prefilled in full.
    system = {"role": "system", "content": "Be brief."}
    a = [system, {"role": "user", "content": "tell me about owls"}]
    b = [system, {"role": "user", "content": "and about herons"}]
    await post(client, CHAT, {"messages": a, "max_tokens": 2})
    _, second, _ = await post(client, CHAT, {"messages": b, "max_tokens": 2})
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_models_list_survives_a_missing_hugging_face_cache(client, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "does-not-exist"))
    response = await client.get("/v1/models")
    assert response.status_code == 200
    body = await response.get_json()
    assert [m["id"] for m in body["data"]] == [client.app.extensions["runtime"].model_id]


async def test_content_parts_and_tool_messages_render(client):
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18}'},
    ]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    status, body, _ = await post(client, CHAT, {"messages": messages, "tools": tools, "max_tokens": 4})
    assert status == 200, body
    status, body, _ = await post(client, CHAT, {"messages": [
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{not json"}}]},
        {"role": "user", "content": "x"}]})
    assert status == 400 and "arguments" in body["error"]["param"]


async def test_xtc_sampling_is_accepted_and_checked(client):
    body = chat_body("pick", max_tokens=6, temperature=1.0, xtc_probability=1.0, xtc_threshold=0.1)
    status, data, _ = await post(client, CHAT, body)
    assert status == 200, data
    status, data, _ = await post(client, CHAT, {**body, "xtc_probability": 1.5})
    assert status == 400 and data["error"]["param"] == "xtc_probability"


async def test_role_mapping_for_a_model_without_a_chat_template(tmp_path):
    from runtime.tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path / "plain")
    config_file = path / "tokenizer_config.json"
    tokenizer_config = json.loads(config_file.read_text())
    del tokenizer_config["chat_template"]
    config_file.write_text(json.dumps(tokenizer_config))
    app = create_app(ServerConfig(model=str(path)))
    async with app.test_app() as test_app:
        c = test_app.test_client()
        await wait_ready(c)
        messages = [{"role": "user", "content": "hello"}]
        _, default, _ = await post(c, CHAT, {"messages": messages, "max_tokens": 2})
        mapping = {"system_prompt": "", "user": "Q: ", "assistant": "A: ", "stop": "\n"}
        _, mapped, _ = await post(
            c, CHAT, {"messages": messages, "max_tokens": 2, "role_mapping": mapping}
        )
    # mlx_lm.server's default mapping adds a long system preamble; "Q: hello\nA:" is short.
    assert mapped["usage"]["prompt_tokens"] < default["usage"]["prompt_tokens"]
    assert mapped["usage"]["prompt_tokens"] <= 8


async def test_a_stream_interval_merges_tokens_into_fewer_chunks(tiny_model_path):
    body = chat_body("tell me a story", stream=True, max_tokens=24, temperature=0.0)
    body["stream_options"] = {"include_usage": True}
    texts = {}
    for interval in (0.0, 400.0):
        config = ServerConfig(model=tiny_model_path, stream_interval_ms=interval)
        app = create_app(config)
        async with app.test_app() as test_app:
            c = test_app.test_client()
            await wait_ready(c)
            status, _, raw = await stream_post(c, CHAT, body)
        assert status == 200
        payloads, _, done = parse_sse(raw)
        assert done
        deltas = [p["choices"][0]["delta"] for p in payloads if p["choices"]]
        text = "".join((d.get("content") or "") + (d.get("reasoning") or "") for d in deltas)
        tokens = payloads[-1]["usage"]["completion_tokens"]
        content_chunks = sum(1 for d in deltas if d.get("content") or d.get("reasoning"))
        texts[interval] = (text, tokens, content_chunks)
    (text0, tokens0, chunks0), (text1, tokens1, chunks1) = texts[0.0], texts[400.0]
    assert (text1, tokens1) == (text0, tokens0)  # the same answer, greedy
    assert tokens1 > 8
    assert chunks1 <= 3 < chunks0  # the first token at once, the rest merged


@pytest.mark.parametrize(
    "error, status, retry_after, param",
    [
        (Failed(message="the engine stopped", status=503, type="service_unavailable",
                retry_after=5), 503, "5", None),
        (Failed(message="boom"), 500, None, None),
        (Overloaded("the queue is full", retry_after=1), 429, "1", None),
        (Unavailable("the model is loading", retry_after=30), 503, "30", None),
        (ClientError("top_p must be at most 1, got 2", param="top_p"), 400, None, "top_p"),
        (werkzeug.exceptions.MethodNotAllowed(), 405, None, None),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, Exception | Failed) else None,
)
def test_every_error_answer_has_the_openai_body_and_its_own_retry_after(
    error, status, retry_after, param
):
    answer = error_answer(error)
    assert answer.status == status
    assert answer.headers.get("Retry-After") == retry_after
    detail = answer.body["error"]
    assert set(answer.body) == {"error"} and set(detail) == {"message", "type", "param", "code"}
    assert detail["param"] == param and detail["message"]
    assert error_body(error) == answer.body


async def test_unknown_path_and_wrong_method_are_openai_errors(client):
    response = await client.get(CHAT)
    assert response.status_code == 405
    body = await response.get_json()
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
