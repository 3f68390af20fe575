"""Score a demo model directory on held-out prompts.

    python -m demo_model.evaluate MODEL_DIR [--n 200] [--json PATH]

Draws ``--n`` held-out examples of each kind in ``demo_model.data.EVAL_KINDS``
(cities, number pairs and phrasings the training never saw), renders each
prompt with the model's own chat template as the server does, generates
greedily with mlx-lm's ``BatchGenerator``, parses tool calls with the
tokenizer's tool parser (``json_tools``) and prints a table of:

* tool-call format valid: the reply is exactly one ``<tool_call>`` block
  whose JSON the parser reads into a name and an arguments object;
* tool + arguments right: and it names the expected tool with the expected
  arguments;
* arithmetic right, thinking on (the answer after ``</think>``) and off (the
  whole reply);
* tool result used: the answer after a tool result mentions the values of
  the result (temperature and condition, or the time);
* fixed answers exact: greetings and questions about the model;
* ends with EOS within budget: the reply stops on ``<|im_end|>`` within twice
  the reference reply's length plus 8 tokens (for a fixed-answer prompt, the
  longest fixed answer's: any of them is a whole reply).

The figures and up to five failures per kind go to a JSON file
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

TARGETS = {
    "tool_call_format_valid": 95.0,
    "tool_call_right": 95.0,
    "arithmetic_right_thinking": 90.0,
    "arithmetic_right_no_thinking": 90.0,
    "ends_with_eos_within_budget": 100.0,
}
LABELS = {
    "tool_call_format_valid": "tool-call format valid",
    "tool_call_right": "tool + arguments right",
    "arithmetic_right_thinking": "arithmetic right, thinking on",
    "arithmetic_right_no_thinking": "arithmetic right, thinking off",
    "tool_result_used": "answer uses the tool result",
    "fixed_answer_exact": "fixed answers exact",
    "ends_with_eos_within_budget": "ends with EOS within budget",
}
TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def generate(model, tokenizer, prompts: list[list[int]], budgets: list[int], batch: int):
    """Greedy replies: (token ids without the end token, finish reason) per prompt."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(
        model,
        stop_tokens=[[t] for t in tokenizer.eos_token_ids],
        completion_batch_size=batch,
        prefill_batch_size=min(batch, 32),
    )
    uids = gen.insert(prompts, budgets)
    tokens: dict[int, list[int]] = {uid: [] for uid in uids}
    finish: dict[int, str] = {}
    try:
        while responses := gen.next_generated():
            for r in responses:
                if r.finish_reason != "stop":
                    tokens[r.uid].append(r.token)
                if r.finish_reason is not None:
                    finish[r.uid] = r.finish_reason
    finally:
        gen.close()
    return [(tokens[uid], finish.get(uid, "length")) for uid in uids]


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


def score(example: data.Example, text: str, finish: str, tokenizer) -> dict[str, Any]:
    """Per-example verdicts: metric name -> bool."""
    out: dict[str, Any] = {"ends_with_eos_within_budget": finish == "stop"}
    kind = example.kind
    if kind in ("weather_call", "time_call"):
        call, why = parse_tool_call(text, tokenizer, example.tools)
        out["tool_call_format_valid"] = call is not None and finish == "stop"
        out["tool_call_right"] = out["tool_call_format_valid"] and call == example.expect["call"]
        if why:
            out["why"] = why
    elif kind == "arith_think":
        answer = text.rsplit("</think>", 1)[-1].strip() if "<think>" in text else None
        out["arithmetic_right_thinking"] = answer == str(example.expect["answer"])
    elif kind == "arith_nothink":
        out["arithmetic_right_no_thinking"] = text.strip() == str(example.expect["answer"])
    elif kind in ("weather_answer", "time_answer"):
        out["tool_result_used"] = all(m in text for m in example.expect["mentions"])
    elif kind == "chat":
        out["fixed_answer_exact"] = text.strip() == example.expect["answer"]
    return out


def evaluate(model_dir: str, n: int = 200, seed: int = 0, batch: int = 64) -> dict[str, Any]:
    import mlx_lm

    model, tokenizer = mlx_lm.load(model_dir)
    examples = data.heldout_set(n, seed=seed)
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
        references = [answer for _, _, answer in data.INTENTS.values()]
        reference = max(references, key=len) if ex.kind == "chat" else ex.target
        n_reference = len(tokenizer.encode(reference, add_special_tokens=False))
        budgets.append(2 * (n_reference + 1) + 8)
    t0 = time.perf_counter()
    replies = generate(model, tokenizer, prompts, budgets, batch)
    seconds = time.perf_counter() - t0
    n_tokens = sum(len(t) for t, _ in replies)

    verdicts: dict[str, list[bool]] = {}
    per_kind: dict[str, dict[str, Any]] = {}
    for ex, (toks, finish) in zip(examples, replies, strict=True):
        text = tokenizer.decode(toks)
        v = score(ex, text, finish, tokenizer)
        kind = per_kind.setdefault(ex.kind, {"n": 0, "eos": 0, "failures": []})
        kind["n"] += 1
        kind["eos"] += int(v["ends_with_eos_within_budget"])
        ok = True
        for metric, value in v.items():
            if metric in LABELS:
                verdicts.setdefault(metric, []).append(bool(value))
                ok = ok and bool(value)
        if not ok and len(kind["failures"]) < 5:
            kind["failures"].append(
                {
                    "prompt": ex.messages[-1]["content"],
                    "thinking": ex.thinking,
                    "expected": ex.target,
                    "got": text,
                    "finish": finish,
                    **({"why": v["why"]} if "why" in v else {}),
                }
            )
    metrics = {
        m: {"percent": round(100.0 * sum(vs) / len(vs), 1), "n": len(vs)}
        for m, vs in ((m, verdicts[m]) for m in LABELS if m in verdicts)
    }
    for m, target in TARGETS.items():
        if m in metrics:
            metrics[m]["target"] = target
            metrics[m]["pass"] = metrics[m]["percent"] >= target
    return {
        "model_dir": str(model_dir),
        "n_per_kind": n,
        "seed": seed,
        "metrics": metrics,
        "per_kind": per_kind,
        "generation": {
            "seconds": round(seconds, 1),
            "tokens": n_tokens,
            "tokens_per_second": round(n_tokens / max(seconds, 1e-9), 1),
        },
    }


def format_table(report: dict[str, Any]) -> str:
    rows = [("metric", "%", "n", "target")]
    for m, v in report["metrics"].items():
        target = f">= {v['target']:g} {'ok' if v['pass'] else 'MISSED'}" if "target" in v else ""
        rows.append((LABELS[m], f"{v['percent']:.1f}", str(v["n"]), target))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [
        "  ".join(
            cell.ljust(w) if i in (0, 3) else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(r, widths, strict=True))
        ).rstrip()
        for r in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    g = report["generation"]
    lines.append(
        f"({g['tokens']} tokens generated in {g['seconds']}s, {g['tokens_per_second']} tok/s)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m demo_model.evaluate",
        description="Score a demo model directory on held-out prompts.",
    )
    parser.add_argument("model_dir")
    parser.add_argument("--n", type=int, default=200, help="held-out prompts per kind")
    parser.add_argument("--seed", type=int, default=0, help="which held-out prompts to draw")
    parser.add_argument("--batch", type=int, default=64, help="sequences generated at once")
    parser.add_argument("--json", default=None, help="report path (default MODEL_DIR/eval.json)")
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    report = evaluate(ns.model_dir, n=ns.n, seed=ns.seed, batch=ns.batch)
    path = pathlib.Path(ns.json) if ns.json else pathlib.Path(ns.model_dir) / "eval.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    sys.stdout.write(format_table(report) + "\n")
    logger.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
