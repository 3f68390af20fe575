"""Train the mlx-trio-demo model from a seed and export an MLX model directory.

    python -m demo_model.train OUT_DIR [--seed 0] [--steps N] [--batch B] [--quick]

Builds the tokenizer and the synthetic conversations (``demo_model.data``),
trains a small Qwen3 (``mlx_lm.models.qwen3``) with a masked cross-entropy on
the assistant replies, and writes ``model.safetensors``, ``config.json`` and
the tokenizer files to OUT_DIR so that ``mlx_lm.load(OUT_DIR)`` loads it.
The same code runs on the CPU and on an NVIDIA GPU (mlx-cuda): mlx uses the
GPU when there is one. Everything depends only on the seed and the flags.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import pathlib
import random
import sys
import time
from functools import partial

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3

from demo_model import MODEL_ID, data

logger = logging.getLogger("demo_model.train")

# Model shape: ~4.9 M parameters, 9.8 MB in bfloat16.
HIDDEN = 256
LAYERS = 6
INTERMEDIATE = 768
HEADS = 4
KV_HEADS = 2

DEFAULT_STEPS = 3000
DEFAULT_BATCH = 64
DEFAULT_POOL = 96_000
# --quick: a pipeline smoke test that finishes in a minute or two even on
# mlx-cpu's reference BLAS (the real shape runs ~10 s/step there).
QUICK_STEPS = 30
QUICK_BATCH = 8
QUICK_SHAPE = {"hidden": 64, "layers": 2, "intermediate": 128}
LENGTH_MULTIPLE = 64  # pad batches to a multiple of this: few distinct shapes to compile
SORT_GROUP = 8  # sort this many batches' worth of examples by length, then split


def model_config(
    vocab_size: int,
    eos_id: int,
    dtype: str,
    hidden: int = HIDDEN,
    layers: int = LAYERS,
    intermediate: int = INTERMEDIATE,
) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": hidden // HEADS,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "torch_dtype": dtype,
        "eos_token_id": eos_id,
    }


def count_params(model: nn.Module) -> int:
    return sum(v.size for _, v in tree_flatten(model.parameters()))


def flops_per_token(config: dict, n_params: int, context: float) -> float:
    """Training FLOPs per token: 6 per weight (embedding included, as the
    tied output layer), plus attention scores and values (12 * layers * d * context)."""
    attn = 12 * config["num_hidden_layers"] * config["hidden_size"] * context
    return 6 * n_params + attn


class Batches:
    """Length-bucketed, padded batches over a pool of encoded examples.

    Each epoch shuffles the pool with ``rng``, sorts groups of
    ``SORT_GROUP * batch`` examples by length, cuts them into batches and
    shuffles the batches, so padding stays small and the order depends only
    on the seed.
    """

    def __init__(self, encoded: list[tuple[list[int], list[int]]], batch: int, pad_id: int, rng):
        if len(encoded) < batch:
            raise ValueError(f"pool of {len(encoded)} examples is smaller than a batch ({batch})")
        self.encoded = encoded
        self.batch = batch
        self.pad_id = pad_id
        self.rng = rng
        self._queue: list[list[int]] = []
        self.epoch = 0

    def _refill(self) -> None:
        idx = list(range(len(self.encoded)))
        self.rng.shuffle(idx)
        group = SORT_GROUP * self.batch
        batches = []
        for g in range(0, len(idx) - self.batch + 1, group):
            chunk = sorted(idx[g : g + group], key=lambda i: len(self.encoded[i][0]))
            for b in range(0, len(chunk) - self.batch + 1, self.batch):
                batches.append(chunk[b : b + self.batch])
        self.rng.shuffle(batches)
        self._queue = batches
        self.epoch += 1

    def next(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if not self._queue:
            self._refill()
        rows = [self.encoded[i] for i in self._queue.pop()]
        longest = max(len(ids) for ids, _ in rows) - 1  # inputs drop the last token
        width = -(-longest // LENGTH_MULTIPLE) * LENGTH_MULTIPLE
        inputs = np.full((len(rows), width), self.pad_id, dtype=np.int32)
        targets = np.full((len(rows), width), self.pad_id, dtype=np.int32)
        mask = np.zeros((len(rows), width), dtype=np.float32)
        for r, (ids, m) in enumerate(rows):
            n = len(ids) - 1
            inputs[r, :n] = ids[:-1]
            targets[r, :n] = ids[1:]
            mask[r, :n] = m[1:]
        return inputs, targets, mask


def loss_fn(model: nn.Module, inputs: mx.array, targets: mx.array, mask: mx.array) -> mx.array:
    logits = model(inputs).astype(mx.float32)
    ce = nn.losses.cross_entropy(logits, targets, reduction="none")
    return (ce * mask).sum() / mx.maximum(mask.sum(), 1.0)


class Progress:
    """A one-line progress bar on a TTY; nothing otherwise."""

    def __init__(self, total: int):
        self.total = total
        self.enabled = sys.stderr.isatty()

    def update(self, step: int, loss: float) -> None:
        if not self.enabled:
            return
        width = 30
        done = int(width * step / self.total)
        sys.stderr.write(
            f"\r[{'#' * done}{'.' * (width - done)}] {step}/{self.total} loss {loss:.4f}"
        )
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def export(model: nn.Module, config: dict, out: pathlib.Path, dtype: str) -> int:
    """Write model.safetensors and config.json; returns the weights' bytes."""
    mx_dtype = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}[dtype]
    weights = {k: v.astype(mx_dtype) for k, v in tree_flatten(model.parameters())}
    mx.eval(weights)
    path = out / "model.safetensors"
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path.stat().st_size


def train(
    out_dir: str,
    *,
    seed: int = 0,
    steps: int = DEFAULT_STEPS,
    batch: int = DEFAULT_BATCH,
    pool: int = DEFAULT_POOL,
    lr: float = 2e-3,
    warmup: int = 100,
    weight_decay: float = 0.05,
    log_every: int = 50,
    dtype: str = "bfloat16",
    compile: bool = True,
    hidden: int = HIDDEN,
    layers: int = LAYERS,
    intermediate: int = INTERMEDIATE,
) -> dict:
    t_start = time.perf_counter()
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    logger.info("device: %s", mx.default_device())

    # Tokenizer, written first: the training text is rendered by the very
    # tokenizer (and chat template) that mlx_lm.load will build.
    tokenizer = data.build_tokenizer(seed=seed)
    data.write_tokenizer(tokenizer, out)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    eos_id = tokenizer.token_to_id(data.EOS)
    pad_id = tokenizer.token_to_id(data.PAD)

    n_examples = min(steps * batch, pool)
    t0 = time.perf_counter()
    examples = data.generate(n_examples, seed=seed)
    encoded = data.encode_parallel(out, examples)
    lengths = np.array([len(ids) for ids, _ in encoded])
    supervised = np.array([sum(m) for _, m in encoded])
    logger.info(
        "data: %d examples (%.1f epochs) in %.1fs; %.0f tokens/example (max %d), "
        "%.1f supervised tokens/example",
        n_examples,
        steps * batch / n_examples,
        time.perf_counter() - t0,
        lengths.mean(),
        lengths.max(),
        supervised.mean(),
    )

    mx.random.seed(seed)
    config = model_config(vocab_size, eos_id, dtype, hidden, layers, intermediate)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    n_params = count_params(model)

    schedule = optim.join_schedules(
        [
            optim.linear_schedule(lr / warmup, lr, warmup),
            optim.cosine_decay(lr, max(1, steps - warmup), end=lr * 0.05),
        ],
        [warmup],
    )
    optimizer = optim.AdamW(
        learning_rate=schedule, betas=[0.9, 0.98], eps=1e-8, weight_decay=weight_decay
    )
    loss_and_grad = nn.value_and_grad(model, loss_fn)

    def step_fn(inputs, targets, mask):
        loss, grads = loss_and_grad(model, inputs, targets, mask)
        grads, grad_norm = optim.clip_grad_norm(grads, max_norm=1.0)
        optimizer.update(model, grads)
        return loss, grad_norm

    if compile:
        state = [model.state, optimizer.state]
        step_fn = partial(mx.compile, inputs=state, outputs=state)(step_fn)

    batches = Batches(encoded, batch, pad_id, random.Random(f"batches-{seed}"))
    # tokens per step, padding included, estimated from the pool's lengths
    padded_len = math.ceil((lengths.mean() - 1) / LENGTH_MULTIPLE + 0.5) * LENGTH_MULTIPLE
    tokens_per_step = batch * padded_len
    fpt = flops_per_token(config, n_params, context=lengths.mean() / 2)
    total_flops = fpt * tokens_per_step * steps
    logger.info(
        "model: qwen3 %d layers, hidden %d, %d heads / %d kv, vocab %d: %d parameters "
        "(%.1f MB in %s)",
        layers,
        hidden,
        HEADS,
        KV_HEADS,
        vocab_size,
        n_params,
        n_params * (4 if dtype == "float32" else 2) / 1e6,
        dtype,
    )
    logger.info(
        "training: %d steps x %d sequences, ~%d tokens/step (padded), ~%.2fM tokens; "
        "~%.2e FLOPs (%.2e per step)",
        steps,
        batch,
        tokens_per_step,
        tokens_per_step * steps / 1e6,
        total_flops,
        fpt * tokens_per_step,
    )

    model.train()
    progress = Progress(steps)
    losses: list[float] = []
    window_loss, window_tokens, window_t = 0.0, 0, time.perf_counter()
    t_train = time.perf_counter()
    first_loss = None
    for step in range(1, steps + 1):
        inputs, targets, mask = batches.next()
        loss, grad_norm = step_fn(mx.array(inputs), mx.array(targets), mx.array(mask))
        mx.eval(loss, grad_norm, model.parameters(), optimizer.state)
        loss_v = loss.item()
        if first_loss is None:
            first_loss = loss_v
        losses.append(loss_v)
        window_loss += loss_v
        window_tokens += inputs.size
        progress.update(step, loss_v)
        if step % log_every == 0 or step == steps:
            n = step % log_every or log_every
            dt = time.perf_counter() - window_t
            logger.info(
                "step %d/%d loss %.4f lr %.2e grad %.2f | %.0f tok/s, %.3f s/step, epoch %d",
                step,
                steps,
                window_loss / n,
                float(schedule(mx.array(step))),
                grad_norm.item(),
                window_tokens / dt,
                dt / n,
                batches.epoch,
            )
            window_loss, window_tokens, window_t = 0.0, 0, time.perf_counter()
    progress.close()
    train_seconds = time.perf_counter() - t_train

    model.eval()
    size = export(model, config, out, dtype)
    summary = {
        "model_id": MODEL_ID,
        "seed": seed,
        "steps": steps,
        "batch": batch,
        "pool": n_examples,
        "lr": lr,
        "warmup": warmup,
        "weight_decay": weight_decay,
        "dtype": dtype,
        "parameters": n_params,
        "weights_bytes": size,
        "tokens_per_step_estimate": tokens_per_step,
        "flops_estimate": total_flops,
        "first_loss": first_loss,
        "final_loss": float(np.mean(losses[-min(len(losses), log_every) :])),
        "train_seconds": round(train_seconds, 1),
        "seconds_per_step": round(train_seconds / steps, 4),
        "total_seconds": round(time.perf_counter() - t_start, 1),
        "device": str(mx.default_device()),
        "mlx_version": mx.__version__,
    }
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    logger.info(
        "wrote %s (%.1f MB weights) in %.0fs (%.3f s/step); final loss %.4f",
        out,
        size / 1e6,
        summary["total_seconds"],
        summary["seconds_per_step"],
        summary["final_loss"],
    )
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m demo_model.train", description="Train the mlx-trio-demo model."
    )
    parser.add_argument("out_dir", help="where to write the MLX model directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None, help=f"default {DEFAULT_STEPS}")
    parser.add_argument(
        "--batch", type=int, default=None, help=f"sequences per step, default {DEFAULT_BATCH}"
    )
    parser.add_argument(
        "--pool",
        type=int,
        default=DEFAULT_POOL,
        help="distinct examples at most (reused by epochs)",
    )
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument(
        "--warmup", type=int, default=None, help="warm-up steps, default 100 (quick: 5)"
    )
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--log-every", type=int, default=None, help="default 50 (quick: 5)")
    parser.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32"),
        default="bfloat16",
        help="exported weights",
    )
    parser.add_argument("--hidden", type=int, default=None, help=f"default {HIDDEN}")
    parser.add_argument("--layers", type=int, default=None, help=f"default {LAYERS}")
    parser.add_argument(
        "--intermediate", type=int, default=None, help=f"MLP width, default {INTERMEDIATE}"
    )
    parser.add_argument("--no-compile", action="store_true", help="do not mx.compile the step")
    parser.add_argument(
        "--quick", action="store_true", help=f"smoke test: {QUICK_STEPS} steps of {QUICK_BATCH}"
    )
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    steps = ns.steps or (QUICK_STEPS if ns.quick else DEFAULT_STEPS)
    batch = ns.batch or (QUICK_BATCH if ns.quick else DEFAULT_BATCH)
    warmup = ns.warmup if ns.warmup is not None else (5 if ns.quick else 100)
    log_every = ns.log_every or (5 if ns.quick else 50)
    shape = (
        QUICK_SHAPE
        if ns.quick
        else {"hidden": HIDDEN, "layers": LAYERS, "intermediate": INTERMEDIATE}
    )
    train(
        ns.out_dir,
        seed=ns.seed,
        steps=steps,
        batch=batch,
        pool=ns.pool,
        lr=ns.lr,
        warmup=min(warmup, max(1, steps // 2)),
        weight_decay=ns.weight_decay,
        log_every=log_every,
        dtype=ns.dtype,
        compile=not ns.no_compile,
        hidden=ns.hidden or shape["hidden"],
        layers=ns.layers or shape["layers"],
        intermediate=ns.intermediate or shape["intermediate"],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
