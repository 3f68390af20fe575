"""Score a demo model directory on held-out prompts.

    python -m demo_model.evaluate MODEL_DIR [--n 200] [--batch 256] [--json PATH]

Draws held-out examples of each kind in ``demo_model.data.EVAL_KINDS``
(``--n`` of each, four times that of arithmetic with and without thinking
and three times that of out-of-range arithmetic: numbers, phrasings,
operations, tool names and parameter names the training never saw), renders
each prompt with the model's own chat template as the server does, decodes
greedily in batches (``greedy_replies``: one forward pass a step for a whole
batch of left-padded prompts, over mlx-lm's ``BatchKVCache``), parses tool
calls with the tokenizer's tool parser (``json_tools``) and prints a table of:

* tool-call format valid: the reply is exactly one ``<tool_call>`` block
  whose JSON the parser reads into a name and an arguments object (the
  standard ``get_weather(city)`` / ``get_time(timezone)`` tools);
* tool + arguments right: and it names the expected tool with the expected
  arguments; the same for tools with held-out names, parameter names and
  descriptions (``..._schema`` kinds);
* "no such tool" answers exact: weather or time asked with no tool for it;
* arithmetic right, thinking on (the answer after ``</think>``) and off (the
  whole reply: the working, which ends in the result);
* out-of-range arithmetic refused: ``data.ARITH_REFUSAL`` word for word;
* arithmetic never wrong: over every arithmetic prompt, in range or not, the
  reply is the right answer or an honest refusal (``ARITH_REFUSAL`` or the
  off-topic answer), never any other number; the rates of right answers
  and of refusals are reported separately;
* tool result used: the answer after a tool result mentions the values of
  the result (temperature and condition, or the time);
* fixed answers exact: greetings and questions about the model;
* ends with EOS within budget: the reply stops on ``<|im_end|>`` within twice
  the reference reply's length plus 8 tokens (for a fixed-answer prompt, the
  longest fixed answer's: any of them is a whole reply); and within 200 tokens.

The figures and up to eight failures per kind go to a JSON file
(``MODEL_DIR/eval.json`` unless ``--json`` says otherwise).
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import re
import sys
import time
from typing import Any

from demo_model import data

logger = logging.getLogger("demo_model.evaluate")

MAX_NEW_TOKENS = 200  # every reply must end within this many tokens
TARGETS = {
    "tool_call_format_valid": 95.0,
    "tool_call_right": 95.0,
    "tool_call_right_schema": 99.0,
    "arithmetic_right_thinking": 90.0,
    "arithmetic_right_no_thinking": 90.0,
    "arithmetic_never_wrong": 100.0,
    "ends_with_eos_within_budget": 100.0,
    "ends_within_200_tokens": 100.0,
}
LABELS = {
    "tool_call_format_valid": "tool-call format valid (standard tools)",
    "tool_call_right": "tool + arguments right (standard tools)",
    "tool_call_right_schema": "tool + arguments right (held-out schemas)",
    "no_tool_answer_exact": '"no such tool" answer exact',
    "arithmetic_right_thinking": "arithmetic right, thinking on",
    "arithmetic_right_no_thinking": "arithmetic right, thinking off",
    "arithmetic_right_below_100": "arithmetic right, both numbers below 100",
    "arithmetic_refused_in_range": "in-range arithmetic refused (honest, not right)",
    "out_of_range_refused": "out-of-range arithmetic refused",
    "arithmetic_never_wrong": "arithmetic never wrong (right or refused)",
    "reasoning_exact": "think trace exact (thinking on)",
    "tool_result_used": "answer uses the tool result",
    "fixed_answer_exact": "fixed answers exact",
    "ends_with_eos_within_budget": "ends with EOS within budget",
    "ends_within_200_tokens": "ends with EOS within 200 tokens",
}
HONEST = (data.ARITH_REFUSAL, data.FALLBACK_ANSWER)
TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def greedy_replies(
    model, prompts: list[list[int]], stop_ids: list[int], pad_id: int, batch: int, max_new: int
) -> list[tuple[list[int], bool]]:
    """Greedy replies, (tokens before the stop token, stopped) per prompt.

    Prompts are sorted by length and decoded ``batch`` at a time, left-padded
    into one ``BatchKVCache`` per layer, one forward pass a step for the whole
    batch until every row has produced a stop token or ``max_new`` tokens.
    """
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import BatchKVCache

    stops = mx.array(stop_ids)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[tuple[list[int], bool]] = [([], False)] * len(prompts)
    for start in range(0, len(order), batch):
        rows = order[start : start + batch]
        width = max(len(prompts[i]) for i in rows)
        left = [width - len(prompts[i]) for i in rows]
        inputs = mx.array([[pad_id] * n + prompts[i] for n, i in zip(left, rows, strict=True)])
        cache = [BatchKVCache(left) for _ in model.layers]
        token = mx.argmax(model(inputs, cache=cache)[:, -1, :], axis=-1)
        done = mx.zeros((len(rows),), dtype=mx.bool_)
        steps = []
        for step in range(max_new):
            steps.append(token)
            done = done | (token[:, None] == stops[None, :]).any(axis=1)
            if step == max_new - 1:
                break
            if step % 8 == 7 and done.all().item():
                break
            token = mx.argmax(model(token[:, None], cache=cache)[:, -1, :], axis=-1)
            mx.async_eval(token, done)
        generated = np.array(mx.stack(steps, axis=1))
        stop_set = set(stop_ids)
        for r, i in enumerate(rows):
            tokens = generated[r].tolist()
            end = next((k for k, t in enumerate(tokens) if t in stop_set), None)
            out[i] = (tokens, False) if end is None else (tokens[:end], True)
    return out


def parse_tool_call(text: str, tokenizer, tools) -> tuple[dict | None, str | None]:
    """The one tool call that ``text`` consists of, or None and why not."""
    blocks = TOOL_CALL_RE.findall(text)
    if len(blocks) != 1:
        return None, f"{len(blocks)} tool-call blocks"
    if TOOL_CALL_RE.sub("", text).strip():
        return None, "text outside the tool-call block"
    parser = getattr(tokenizer, "tool_parser", None)
    if parser is None:
        return None, "the tokenizer has no tool parser"
    try:
        call = parser(blocks[0], tools)
    except Exception as exc:  # the parser raises on malformed JSON
        return None, f"parser: {exc}"
    if not (
        isinstance(call, dict)
        and isinstance(call.get("name"), str)
        and isinstance(call.get("arguments"), dict)
    ):
        return None, "no name and arguments object"
    return call, None


def split_think(text: str) -> tuple[str | None, str]:
    """(the think block's text or None, the answer after it)."""
    if "<think>" in text and "</think>" in text:
        head, answer = text.split("</think>", 1)
        return head.split("<think>", 1)[1].strip(), answer.strip()
    return None, text.strip()


def score(example: data.Example, text: str, stopped: bool, n_tokens: int, budget: int, tokenizer):
    """Per-example verdicts: metric name -> bool (and "why" / "arith" notes)."""
    out: dict[str, Any] = {
        "ends_with_eos_within_budget": stopped and n_tokens < budget,
        "ends_within_200_tokens": stopped,
    }
    kind = example.kind
    if kind in ("weather_call", "time_call", "weather_call_schema", "time_call_schema"):
        call, why = parse_tool_call(text, tokenizer, example.tools)
        valid = call is not None and stopped
        right = valid and call == example.expect["call"]
        if kind.endswith("_schema"):
            out["tool_call_right_schema"] = right
        else:
            out["tool_call_format_valid"] = valid
            out["tool_call_right"] = right
        if why:
            out["why"] = why
    elif kind in data.ARITH_KINDS:
        trace, answer = split_think(text)
        if kind == "arith_refuse":
            out["out_of_range_refused"] = stopped and answer == data.ARITH_REFUSAL
            right = out["out_of_range_refused"]
        else:
            if kind == "arith_think":
                right = stopped and answer == str(example.expect["answer"])
                out["arithmetic_right_thinking"] = right
                reference = data.arith_trace(
                    example.expect["op"], example.expect["a"], example.expect["b"]
                )
                out["reasoning_exact"] = trace == reference
            else:
                right = stopped and text.strip() == example.target
                out["arithmetic_right_no_thinking"] = right
            if max(example.expect["a"], example.expect["b"]) < 100:
                out["arithmetic_right_below_100"] = right
            out["arithmetic_refused_in_range"] = stopped and answer in HONEST
        honest = stopped and answer in HONEST
        out["arithmetic_never_wrong"] = right or honest
        out["arith"] = "right" if right else "refused" if honest else "wrong"
    elif kind in ("weather_answer", "time_answer"):
        out["tool_result_used"] = all(m in text for m in example.expect["mentions"])
    elif kind == "no_tool":
        out["no_tool_answer_exact"] = text.strip() == example.expect["answer"]
    elif kind == "chat":
        out["fixed_answer_exact"] = text.strip() == example.expect["answer"]
    return out


def evaluate(
    model_dir: str,
    n: int = 200,
    seed: int = 0,
    batch: int = 256,
    kinds: list[str] | None = None,
    limit: int | None = None,
) -> dict[str, Any]:
    """The report for ``model_dir``: ``limit`` keeps the first ``limit`` prompts
    of each kind of the same draw (a subset for a slow machine)."""
    import mlx_lm

    model, tokenizer = mlx_lm.load(model_dir)
    examples = data.heldout_set(n, seed=seed, weights=data.EVAL_WEIGHTS)
    if kinds:
        examples = [ex for ex in examples if ex.kind in kinds]
    if limit is not None:
        seen: dict[str, int] = {}
        kept = []
        for ex in examples:
            seen[ex.kind] = seen.get(ex.kind, 0) + 1
            if seen[ex.kind] <= limit:
                kept.append(ex)
        examples = kept
    longest_fixed = max((answer for _, _, answer in data.INTENTS.values()), key=len)
    prompts, budgets = [], []
    for ex in examples:
        prompts.append(
            list(
                tokenizer.apply_chat_template(
                    ex.messages,
                    tools=ex.tools,
                    add_generation_prompt=True,
                    enable_thinking=ex.thinking,
                )
            )
        )
        reference = longest_fixed if ex.kind == "chat" else ex.target
        n_reference = len(tokenizer.encode(reference, add_special_tokens=False))
        budgets.append(2 * (n_reference + 1) + 8)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    t0 = time.perf_counter()
    replies = greedy_replies(
        model, prompts, sorted(tokenizer.eos_token_ids), pad_id, batch, MAX_NEW_TOKENS
    )
    seconds = time.perf_counter() - t0
    n_tokens = sum(len(t) + int(stopped) for t, stopped in replies)

    verdicts: dict[str, list[bool]] = {}
    per_kind: dict[str, dict[str, Any]] = {}
    arith_outcomes: dict[str, int] = {"right": 0, "refused": 0, "wrong": 0}
    for ex, (toks, stopped), budget in zip(examples, replies, budgets, strict=True):
        text = tokenizer.decode(toks)
        v = score(ex, text, stopped, len(toks), budget, tokenizer)
        kind = per_kind.setdefault(ex.kind, {"n": 0, "eos": 0, "failures": []})
        kind["n"] += 1
        kind["eos"] += int(stopped)
        if "arith" in v:
            arith_outcomes[v["arith"]] += 1
            kind.setdefault("outcomes", {"right": 0, "refused": 0, "wrong": 0})[v["arith"]] += 1
        ok = True
        for metric, value in v.items():
            if metric in LABELS:
                verdicts.setdefault(metric, []).append(bool(value))
                if metric not in ("reasoning_exact", "arithmetic_refused_in_range"):
                    ok = ok and bool(value)
        if not ok and len(kind["failures"]) < 8:
            kind["failures"].append(
                {
                    "prompt": ex.messages[-1]["content"],
                    "tools": [t["function"]["name"] for t in ex.tools or []],
                    "thinking": ex.thinking,
                    "expected": ex.target,
                    "got": text,
                    "stopped": stopped,
                    **({"why": v["why"]} if "why" in v else {}),
                    **({"outcome": v["arith"]} if "arith" in v else {}),
                }
            )
    metrics = {
        m: {"percent": round(100.0 * sum(vs) / len(vs), 2), "n": len(vs)}
        for m, vs in ((m, verdicts[m]) for m in LABELS if m in verdicts)
    }
    for m, target in TARGETS.items():
        if m in metrics:
            metrics[m]["target"] = target
            metrics[m]["pass"] = metrics[m]["percent"] >= target
    return {
        "model_dir": str(model_dir),
        "n_per_kind": n,
        "limit_per_kind": limit,
        "weights": data.EVAL_WEIGHTS,
        "seed": seed,
        "metrics": metrics,
        "arithmetic_outcomes": arith_outcomes,
        "per_kind": per_kind,
        "generation": {
            "prompts": len(examples),
            "batch": batch,
            "seconds": round(seconds, 1),
            "tokens": n_tokens,
            "tokens_per_second": round(n_tokens / max(seconds, 1e-9), 1),
        },
    }


def format_table(report: dict[str, Any]) -> str:
    rows = [("metric", "%", "n", "target")]
    for m, v in report["metrics"].items():
        target = f">= {v['target']:g} {'ok' if v['pass'] else 'MISSED'}" if "target" in v else ""
        rows.append((LABELS[m], f"{v['percent']:.2f}", str(v["n"]), target))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [
        "  ".join(
            cell.ljust(w) if i in (0, 3) else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(r, widths, strict=True))
        ).rstrip()
        for r in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    o = report["arithmetic_outcomes"]
    lines.append(
        f"arithmetic prompts: {sum(o.values())}: {o['right']} right, {o['refused']} refused, "
        f"{o['wrong']} wrong"
    )
    g = report["generation"]
    lines.append(
        f"({g['prompts']} prompts, {g['tokens']} tokens generated in {g['seconds']}s, "
        f"{g['tokens_per_second']} tok/s, batch {g['batch']})"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m demo_model.evaluate",
        description="Score a demo model directory on held-out prompts.",
    )
    parser.add_argument("model_dir")
    parser.add_argument(
        "--n",
        type=int,
        default=200,
        help="held-out prompts per kind (arithmetic: data.EVAL_WEIGHTS times as many)",
    )
    parser.add_argument("--seed", type=int, default=0, help="which held-out prompts to draw")
    parser.add_argument("--batch", type=int, default=256, help="sequences decoded at once")
    parser.add_argument("--kinds", nargs="*", default=None, help="only these kinds")
    parser.add_argument(
        "--limit",
        type=int,
        default=None,
        help="only the first LIMIT prompts of each kind of the same draw (a CPU subset)",
    )
    parser.add_argument("--json", default=None, help="report path (default MODEL_DIR/eval.json)")
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    report = evaluate(
        ns.model_dir, n=ns.n, seed=ns.seed, batch=ns.batch, kinds=ns.kinds, limit=ns.limit
    )
    path = pathlib.Path(ns.json) if ns.json else pathlib.Path(ns.model_dir) / "eval.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    sys.stdout.write(format_table(report) + "\n")
    logger.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
