"""Preemption end to end, on the real tiny model: requests asking for long replies
start within the KV budget on a reply reserve, and when their replies outgrow it the
latest leave the engine and resume from their tokens so far. Each client still gets
its whole reply in one stream, the same as when it ran alone (greedy), with usage
and one terminal event; and two Claude Code-shaped requests (/v1/messages asking for
64,000 tokens) run together where reserving max_tokens whole ran them one at a time
(docs/operations.md#admission)."""

from __future__ import annotations

import json

import trio

from api.server import create_app
from runtime.config import ServerConfig
from tests.conftest import wait_ready
from tests.test_api import chat_body, parse_sse, post, stream_post

CHAT = "/v1/chat/completions"
BYTES_PER_TOKEN = 512  # the tiny model: 2 layers x 2 kv heads x 16 dims x (K, V) x 4 bytes
REPLY = 90


def question(i: int, never_end: dict) -> dict:
    return chat_body(f"question {i}: tell me a long story", max_tokens=REPLY,
                     logit_bias=never_end)


async def test_replies_that_outgrow_the_budget_are_preempted_and_resumed_whole(
    tiny_model_path, tiny_tokenizer
):
    never_end = {str(e): -100 for e in tiny_tokenizer.eos_token_ids}
    # 200 tokens of KV cache: each request (about 25 prompt tokens + 90) fits alone, and
    # three start together on a reserve of 16 reply tokens each, then outgrow it.
    config = ServerConfig(
        model=tiny_model_path,
        kv_cache_budget_bytes=200 * BYTES_PER_TOKEN,
        kv_reply_reserve_tokens=16,
    )
    app = create_app(config)
    async with app.test_app() as test_app:
        client = test_app.test_client()
        await wait_ready(client)
        alone = []
        for i in range(3):
            status, body, _ = await post(client, CHAT, question(i, never_end))
            assert status == 200
            alone.append(body)
        health = await (await client.get("/health")).get_json()
        assert health["kv_cache"]["preemptions"] == 0  # one at a time: nothing to preempt

        together: list = [None] * 3

        async def ask(i: int) -> None:
            body = dict(question(i, never_end), stream=True,
                        stream_options={"include_usage": True})
            together[i] = await stream_post(client, CHAT, body)

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(ask, i)

        health = await (await client.get("/health")).get_json()
        assert health["kv_cache"]["preemptions"] >= 1
        assert health["kv_cache"]["reserved_bytes"] == 0
        for i, (status, _, raw) in enumerate(together):
            assert status == 200
            payloads, _, done = parse_sse(raw)
            assert done
            text = "".join(
                p["choices"][0]["delta"].get("content") or "" for p in payloads if p["choices"]
            )
            finishes = [p["choices"][0]["finish_reason"] for p in payloads
                        if p["choices"] and p["choices"][0]["finish_reason"]]
            usage = payloads[-1]["usage"]
            assert text == alone[i]["choices"][0]["message"]["content"], i
            assert finishes == ["length"]
            assert usage["completion_tokens"] == REPLY
            assert usage["prompt_tokens"] == alone[i]["usage"]["prompt_tokens"]
        metrics = (await (await client.get("/metrics")).get_data()).decode()
        line = next(x for x in metrics.splitlines() if x.startswith("mlx_trio_preemptions_total"))
        assert float(line.split()[-1]) == health["kv_cache"]["preemptions"]
        json.dumps(health)  # /health stays plain JSON


async def two_agent_requests(tiny_model_path, body: dict, reserve: int) -> tuple[int, list]:
    """Two ``body`` requests at once on a 200-token budget: the most that ran at once,
    and the answers."""
    config = ServerConfig(
        model=tiny_model_path,
        kv_cache_budget_bytes=200 * BYTES_PER_TOKEN,
        kv_reply_reserve_tokens=reserve,
    )
    app = create_app(config)
    async with app.test_app() as test_app:
        client = test_app.test_client()
        await wait_ready(client)
        scheduler = app.extensions["runtime"].scheduler
        running, answers = [], []

        async def watch():
            while True:
                running.append(scheduler.figures().running)
                await trio.lowlevel.checkpoint()

        async def ask():
            response = await client.post("/v1/messages", json=body)
            answers.append((response.status_code, await response.get_json()))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            async with trio.open_nursery() as inner:
                inner.start_soon(ask)
                inner.start_soon(ask)
            nursery.cancel_scope.cancel()
    return max(running), answers


async def test_claude_code_s_max_tokens_no_longer_holds_the_whole_budget(tiny_model_path):
    """Claude Code asks /v1/messages for 64,000 tokens a reply. With a budget of 200
    tokens, reserving max_tokens whole (as lowered to the budget) lets one such request
    run at a time; with the reply reserve, both start at once, and both are answered."""
    body = {"model": "default_model", "max_tokens": 64000,
            "messages": [{"role": "user", "content": "write the function, please"}]}
    for reserve, together in ((0, 1), (16, 2)):
        most, answers = await two_agent_requests(tiny_model_path, body, reserve)
        assert most == together, reserve
        assert [status for status, _ in answers] == [200, 200]
        assert all(a["type"] == "message" and a["usage"]["output_tokens"] > 0
                   for _, a in answers)


async def test_a_request_waiting_for_the_budget_says_so_in_the_access_log(
    tiny_model_path, tiny_tokenizer, caplog
):
    """Reserving max_tokens whole, a 200-token budget runs one of two requests of about 130 tokens
    at a time: the other waits in the queue until the first has ended, and its access
    line's ``queued_ms`` (and /metrics' ``mlx_trio_request_queue_seconds``) says how long."""
    import logging

    never_end = {str(e): -100 for e in tiny_tokenizer.eos_token_ids}
    config = ServerConfig(model=tiny_model_path, kv_cache_budget_bytes=200 * BYTES_PER_TOKEN,
                          kv_reply_reserve_tokens=0)
    app = create_app(config)
    caplog.set_level(logging.INFO, logger="mlx_trio.access")
    async with app.test_app() as test_app:
        client = test_app.test_client()
        await wait_ready(client)
        caplog.clear()
        async with trio.open_nursery() as nursery:
            for i in range(2):
                nursery.start_soon(post, client, CHAT, question(i, never_end))
        metrics = (await (await client.get("/metrics")).get_data()).decode()
    lines = sorted((r.access for r in caplog.records
                    if r.name == "mlx_trio.access" and r.access["endpoint"] == CHAT),
                   key=lambda line: line["queued_ms"])
    first, second = lines
    assert first["generated_tokens"] == second["generated_tokens"] == REPLY
    # The second started once the first had ended: it waited at least the first's decode.
    assert second["queued_ms"] >= first["duration_ms"] - first["ttft_ms"]
    assert second["submit_ms"] + second["queued_ms"] <= second["ttft_ms"] + 0.2
    assert first["queued_ms"] < first["duration_ms"] - first["ttft_ms"]
    count = next(x for x in metrics.splitlines()
                 if x.startswith("mlx_trio_request_queue_seconds_count"))
    assert float(count.split()[-1]) == 2
