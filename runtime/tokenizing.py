"""Text to token ids on the request path, through the tokenizer's Rust backend when it agrees.

Receives a tokenizer (mlx-lm's ``TokenizerWrapper`` or a Hugging Face
tokenizer) and a text; returns its ids, as ``tokenizer.encode(text,
add_special_tokens=...)`` would. Every request's prompt is encoded once, on
the event loop for short prompts, and transformers' ``encode`` spends more of
that time in Python around the backend than in the backend itself (about
0.35 ms against 0.22 ms for a 130-token prompt on a 2-core CPU). A fast
tokenizer's ``tokenizers.Tokenizer`` is called directly, but only once it has
given the same ids as ``encode`` on a set of probe texts (special tokens,
whitespace, non-ASCII text, a chat rendering): a tokenizer whose Python layer
changes the result keeps the slow path. The verdict (about 20 ms of probes)
is kept per tokenizer object (weakly); the ModelLoader asks for it when a
model is ready, so no request's event loop pays for it.

A long text (``LONG_TEXT_CHARS`` or more: a coding agent's prompt) goes through
the backend's batch call with one text, which lets go of the GIL while Rust
encodes; its single-text ``encode`` holds it throughout. Long prompts are
prepared in worker threads, and preparing a 30,000-token prompt that way stopped
the event loop, and with it every other client's stream, for 15 ms at a stretch
on a 2-core CPU (4 ms through the batch call; ``bench/event_loop_lag.py``).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

Encoder = Callable[[str, bool], list[int]]

# From this many characters, the backend's batch call (which releases the GIL);
# below it, its single-text call, which costs less per call.
LONG_TEXT_CHARS = 4096

_PROBES = (
    "",
    "Hello, world!",
    " leading space and trailing  ",
    "line one\nline two\n\n\ttabbed",
    "Ünïcödé — 東京 🚀 naïve café",
    "12345 + 67890 = 80235",
    "def f(x):\n    return x * 2  # code\n",
)

_encoders: weakref.WeakKeyDictionary[Any, Encoder] = weakref.WeakKeyDictionary()


def encoder_for(tokenizer: Any) -> Encoder:
    """``encode(text, add_special_tokens)`` for ``tokenizer`` (decided once per tokenizer)."""
    try:
        return _encoders[tokenizer]
    except (KeyError, TypeError):
        pass
    chosen = _choose(tokenizer)
    try:
        _encoders[tokenizer] = chosen
    except TypeError:  # not weakly referenceable: decide again next time
        pass
    return chosen


def encode(tokenizer: Any, text: str, *, add_special_tokens: bool = True) -> list[int]:
    return encoder_for(tokenizer)(text, add_special_tokens)


def _slow(tokenizer: Any) -> Encoder:
    def encode_slowly(text: str, add_special_tokens: bool) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))

    return encode_slowly


def _choose(tokenizer: Any) -> Encoder:
    slow = _slow(tokenizer)
    hf, backend = tokenizer, getattr(tokenizer, "_tokenizer", None)
    if backend is not None and hasattr(getattr(backend, "_tokenizer", None), "encode"):
        hf, backend = backend, backend._tokenizer  # mlx-lm's wrapper around an HF tokenizer
    if backend is None or not callable(getattr(backend, "encode", None)):
        return slow
    if getattr(hf, "split_special_tokens", False):
        return slow  # transformers splits special tokens itself then

    batch_call = getattr(backend, "encode_batch_fast", None) or getattr(backend, "encode_batch", None)

    def encode_fast(text: str, add_special_tokens: bool) -> list[int]:
        if batch_call is not None and len(text) >= LONG_TEXT_CHARS:
            return batch_call([text], add_special_tokens=add_special_tokens)[0].ids
        return backend.encode(text, add_special_tokens=add_special_tokens).ids

    try:
        for text in _probe_texts(tokenizer, hf):
            for special in (False, True):
                if encode_fast(text, special) != slow(text, special):
                    log.info("tokenizer: its Python encode differs from its backend; using encode")
                    return slow
    except Exception:  # noqa: BLE001 - any surprise: the documented path
        return slow
    return encode_fast


def _probe_texts(tokenizer: Any, hf: Any) -> list[str]:
    texts = list(_PROBES)
    texts.append("\n".join(_PROBES) * (LONG_TEXT_CHARS // len("\n".join(_PROBES)) + 1))
    specials = [t for t in getattr(hf, "all_special_tokens", ()) or () if isinstance(t, str)]
    if specials:
        texts.append("x" + " ".join(specials[:16]) + "y")
        texts.append("".join(specials[:16]) + "after")
    try:
        rendered = tokenizer.apply_chat_template(
            [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Say hi, then count: 1 2 3."},
            ],
            add_generation_prompt=True,
            tokenize=False,
        )
        if isinstance(rendered, str):
            texts.append(rendered)
    except Exception:  # noqa: BLE001 - no template, or one that needs more: no probe from it
        pass
    return texts
