"""bench/agent_sessions.py's pure parts: the sessions' histories, the prompts, the statistics."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import agent_sessions as bench  # noqa: E402
from loadgen import PromptBuilder  # noqa: E402


def test_each_turn_repeats_the_last_with_its_reply_and_a_new_user_turn():
    conv = bench.Conversation("the tools")
    previous = None
    for turn in range(1, 5):
        request = conv.request(f"user turn {turn}")
        assert request[0] == {"role": "system", "content": "the tools"}
        assert request[-1] == {"role": "user", "content": f"user turn {turn}"}
        if previous is not None:
            prev_request, prev_reply = previous
            assert request[: len(prev_request)] == prev_request
            assert request[len(prev_request)] == {"role": "assistant", "content": prev_reply}
            assert len(request) == len(prev_request) + 2
        reply = f"reply {turn}"
        conv.reply(request, reply)
        previous = (request, reply)
    assert [m["role"] for m in conv.messages] == ["system"] + ["user", "assistant"] * 4


def test_prompts_share_the_system_prompt_and_differ_per_session_and_turn():
    w = bench.AgentWorkload(sessions=3, turns=4, system_tokens=300, user_tokens=(20, 40), seed=7)
    a, b = bench.Prompts(PromptBuilder(), w), bench.Prompts(PromptBuilder(), w)
    assert a.system() == b.system()
    assert a.system().startswith(bench.SYSTEM_LEAD)
    users = {(s, t): a.user(s, t) for s in range(3) for t in range(1, 5)}
    assert len(set(users.values())) == len(users)
    assert users == {(s, t): b.user(s, t) for s in range(3) for t in range(1, 5)}
    assert users[(1, 2)].startswith("Tool result")  # even turns: a tool result
    assert users[(1, 3)].startswith("Session 1 turn 3")
    for s in range(3):
        for t in range(1, 5):
            assert 20 <= w.user_length(s, t) <= 40
            assert w.max_tokens_of(s, t) == 64


def test_ranges_and_levels_parse():
    assert bench.parse_range("64") == (64, 64)
    assert bench.parse_range("64-256") == (64, 256)
    assert bench.parse_levels("1,4,16") == [1, 4, 16]
    for bad in ("0", "9-3", "a-b"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.parse_range(bad)


def test_a_tool_s_pause_comes_before_every_turn_but_the_first():
    assert bench.parse_seconds("2") == (2.0, 2.0)
    assert bench.parse_seconds("0.5-3") == (0.5, 3.0)
    for bad in ("-1", "3-1", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.parse_seconds(bad)
    w = bench.AgentWorkload(sessions=4, turns=6, tool_seconds=(1.0, 3.0))
    pauses = [w.tool_seconds_of(s, t) for s in range(4) for t in range(2, 7)]
    assert all(1.0 <= p <= 3.0 for p in pauses) and len(set(pauses)) > 1
    assert [w.tool_seconds_of(s, 1) for s in range(4)] == [0.0] * 4
    assert pauses == [w.tool_seconds_of(s, t) for s in range(4) for t in range(2, 7)]
    assert bench.AgentWorkload().tool_seconds_of(0, 3) == 0.0  # none by default
    ns = bench.parse_args(["--quick", "--tool-seconds", "1-2"])
    assert ns.tool_seconds == (1.0, 2.0)
    assert bench.warm_up_workload(w).tool_seconds == (0.0, 0.0)


def test_quick_fills_only_what_is_not_given():
    ns = bench.parse_args(["--quick", "--turns", "5", "--systems", "engine,ours"])
    assert ns.turns == 5 and ns.system_tokens == 1500 and ns.sessions == [1, 4]
    assert ns.systems == ["ours", "engine"]  # the alternation's order


def _record(system, turn, *, ttft, prompt, cached, reusable=None, tokens=10, error=None):
    rec = bench.TurnRecord(system, 0, 2, 0, turn, max_tokens=10, user_tokens=50)
    rec.completion_tokens, rec.prompt_tokens, rec.cached_tokens = tokens, prompt, cached
    rec.reusable_tokens, rec.error = reusable, error
    rec.finish([ttft, ttft + 0.01, ttft + 0.03], ttft + 0.03)
    return asdict(rec)


def test_summary_of_synthetic_turns():
    records = [
        _record("ours", 1, ttft=1.0, prompt=1000, cached=0),
        _record("ours", 1, ttft=2.0, prompt=1000, cached=900),
        _record("ours", 2, ttft=0.1, prompt=1200, cached=1000, reusable=1010),
        _record("ours", 2, ttft=0.3, prompt=1200, cached=1010, reusable=1010),
        _record("ours", 3, ttft=9.0, prompt=1, cached=1, error="500: boom"),
    ]
    s = bench.summarize(records, [{"wall_s": 4.0, "cpu_s": 0.4}])
    assert s["turns"] == 5 and s["errors"] == 1
    assert s["completion_tokens"] == 40 and s["tok_s"] == 10.0
    assert s["ttft_turn1_p50_ms"] == 1500.0
    assert s["ttft_later_p50_ms"] == 200.0
    assert s["cached_fraction"] == round(2910 / 4400, 4)
    assert s["cached_fraction_later"] == round(2010 / 2400, 4)
    assert s["reused_of_reusable"] == round(2010 / 2020, 4)
    assert s["itl_p50_ms"] == 15.0  # gaps of 10 and 20 ms in every turn
    assert s["cpu_ms_per_token"] == 10.0
    # four turns streamed 30 ms each from their first token, over 4 s of wall time
    assert s["decoding_rows_mean"] == 0.03
    assert s["by_turn"]["2"]["cached_fraction"] == round(2010 / 2400, 4)
    assert "3" not in s["by_turn"]  # the failed turn counts as an error only


def test_the_turns_queue_waits_come_from_our_access_log(tmp_path):
    """Each turn's ``queued_ms`` is read back from the server's log by its request id
    (a warm-up turn sharing the id is replaced by the measured one, which comes later),
    and the summary gives their p50 and p99; a server without them (mlx_lm.server) has
    none."""
    log = tmp_path / "agent.log"
    log.write_text(
        "2026-12-08 01:00:00,000 INFO mlx_trio.access: request_id=agent-2-0-1 method=POST "
        "endpoint=/v1/chat/completions status=200 submit_ms=1.0 queued_ms=900.0 ttft_ms=950.0\n"
        "2026-12-08 01:00:01,000 INFO mlx_trio.access: request_id=agent-2-0-1 method=POST "
        "endpoint=/v1/chat/completions status=200 submit_ms=1.0 queued_ms=0.5 ttft_ms=40.0\n"
        "2026-12-08 01:00:02,000 INFO mlx_trio.access: request_id=agent-2-1-1 method=POST "
        "endpoint=/v1/chat/completions status=200 submit_ms=1.0 queued_ms=3600.0 ttft_ms=3650.0\n"
        "2026-12-08 01:00:02,500 INFO mlx_trio.access: request_id=x method=GET "
        "endpoint=/health status=200 duration_ms=0.3\n")
    queued = bench.access_queued(log)
    assert queued == {"agent-2-0-1": 0.0005, "agent-2-1-1": 3.6}
    assert bench.access_queued(tmp_path / "none.log") == {}
    rec = bench.TurnRecord("ours", 0, 2, 1, 1, max_tokens=10, user_tokens=50)
    assert bench.turn_request_id(rec) == "agent-2-1-1"
    records = [_record("ours", 1, ttft=0.04, prompt=100, cached=0),
               _record("ours", 1, ttft=3.65, prompt=100, cached=0)]
    records[0]["queued_s"], records[1]["queued_s"] = 0.0005, 3.6
    s = bench.summarize(records, [{"wall_s": 4.0}])
    assert 3500 < s["queued_p99_ms"] <= 3600 and s["queued_p50_ms"] < s["queued_p99_ms"]
    assert bench.summarize(records[:0] + [_record("mlx_lm", 1, ttft=0.1, prompt=1, cached=0)],
                           [{"wall_s": 1.0}])["queued_p50_ms"] is None


def test_summaries_per_level_and_the_table():
    records = [
        _record(system, 1, ttft=0.5, prompt=100, cached=0)
        for system in ("ours", "mlx_lm", "engine")
    ]
    runs = [{"system": s, "sessions": 2, "wall_s": 1.0} for s in ("ours", "mlx_lm", "engine")]
    summary = bench.summarize_all(records, runs)
    assert set(summary["2"]) == {"ours", "mlx_lm", "engine"}
    table = bench.render_table(summary)
    assert "ours/mlx_lm" in table and "ours/engine" in table
    assert "|  rows |" in table.splitlines()[0]


def test_reuse_helpers():
    prev = bench.TurnRecord("engine", 0, 1, 0, 1, 8, 50)
    assert bench.reusable_after(None) is None
    prev.prompt_tokens, prev.completion_tokens = 100, 8
    assert bench.reusable_after(prev) == 108
    assert bench.common_prefix([1, 2, 3, 4], [1, 2, 5]) == 2
    assert bench.common_prefix([], [1]) == 0


def test_variants_are_more_systems_of_ours_with_their_flags_and_tree(tmp_path):
    tree = tmp_path / "before"
    (tree / "api").mkdir(parents=True)
    (tree / "api" / "cli.py").write_text("")
    ns = bench.parse_args(["--systems", "ours,mlx_lm", "--server-args", "--a 1",
                           "--variant", "no-reuse=--decode-row-reuse-steps 0",
                           "--variant", f"before@{tree}=",
                           "--variant", "small-graphs=MLX_MAX_OPS_PER_BUFFER=20 --b '2 3'"])
    assert ns.systems == ["ours", "mlx_lm", "no-reuse", "before", "small-graphs"]
    assert ns.variants["before"] == (tree.resolve(), "", {})
    assert ns.variants["small-graphs"][2] == {"MLX_MAX_OPS_PER_BUFFER": "20"}
    assert bench.server_command("small-graphs", "M", 1, ns)[-2:] == ["--b", "2 3"]
    command = bench.server_command("no-reuse", "M", 1, ns)
    assert command[-4:] == ["--a", "1", "--decode-row-reuse-steps", "0"]
    assert "--decode-row-reuse-steps" not in bench.server_command("ours", "M", 1, ns)
    assert "--a" not in bench.server_command("mlx_lm", "M", 1, ns)
    for bad in ("ours=--x", "noflags", f"missing@{tmp_path / 'none'}=", "a=1"):
        args = ["--variant", bad] + (["--variant", "a=2"] if bad == "a=1" else [])
        with pytest.raises(SystemExit):
            bench.parse_args(args)


def test_a_variant_has_its_own_rows_ratio_and_colour():
    runs = [{"system": s, "sessions": 4} for s in ("ours", "no-reuse", "mlx_lm")]
    assert bench.system_order(runs) == ["ours", "mlx_lm", "no-reuse"]
    assert bench.label("no-reuse") == "mlx-trio-server no-reuse"
    assert bench.color("no-reuse", ["ours", "mlx_lm", "no-reuse"]) not in bench.COLORS.values()
    summary = {"4": {s: {"tok_s": t, **{k: None for k in (
        "ttft_turn1_p50_ms", "ttft_turn1_p99_ms", "ttft_later_p50_ms", "ttft_later_p99_ms",
        "itl_p50_ms", "itl_p99_ms", "cached_fraction", "cached_fraction_later",
        "reused_of_reusable")}, "errors": 0} for s, t in (("ours", 200.0), ("no-reuse", 100.0))}}
    table = bench.render_table(summary)
    assert "ours/no-reuse" in table and " 2.00 " in table


async def test_asking_for_more_closes_the_stream_where_the_reply_ends():
    """--ask-tokens: the request asks for A tokens, and the client stops reading after
    the turn's own length, counting the chunks it read as the reply's tokens."""
    import httpx

    sent: list[dict] = []

    class Chunks(httpx.AsyncByteStream):
        def __init__(self) -> None:
            self.read = 0

        async def __aiter__(self):
            for i in range(50):
                self.read += 1
                delta = {"choices": [{"index": 0, "delta": {"content": f"t{i} "}}]}
                yield f"data: {json.dumps(delta)}\n\n".encode()
            yield b"data: [DONE]\n\n"

    streams: list[Chunks] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        streams.append(Chunks())
        return httpx.Response(200, stream=streams[-1])

    w = bench.AgentWorkload(ask_tokens=32000)
    rec = bench.TurnRecord("ours", 1, 1, 0, 1, 7, 200)
    async with httpx.AsyncClient(transport=httpx.MockTransport(answer), base_url="http://x") as c:
        reply = await bench._http_turn(c, [{"role": "user", "content": "hi"}], rec, 0.0,
                                       w.ask_tokens)
    assert sent[0]["max_tokens"] == 32000
    assert reply == "".join(f"t{i} " for i in range(7))
    assert rec.completion_tokens == 7 and rec.finish_reason == "closed" and rec.error is None
    assert streams[0].read < 50  # it stopped reading
    assert bench.parse_args(["--quick", "--ask-tokens", "64000"]).ask_tokens == 64000
