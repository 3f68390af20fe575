"""Turning a validated request into prompt tokens (no MLX: any thread).

Receives plain chat messages (content already a string, tool-call arguments
already objects; for a gpt-oss model reshaped by ``runtime.harmony``) or a text prompt; returns a ``PreparedPrompt`` with the
tokens, the prompt cache's segment plan, the text state the model starts
in (inside a thinking block or not), and for chat the keys the prompt cache's
miss explanation compares (``template_key``, ``conversation_keys``). Runs in a worker thread
(``trio.to_thread``) because chat templates and tokenizers are slow Python, but for short
prompts (about 1 ms; ``api.http.small_body``), which the Session prepares on the event loop.
``prepare_vision_chat`` (images, a vision-language model) also runs mlx-vlm's processor,
which makes the image tensors as MLX arrays from numpy (no computation on a stream).

``plan_segments`` is the segmentation policy: where in a chat prompt the
engine keeps a copy of the KV cache (end of the system prompt, end of the
conversation before a thinking tail), as mlx_lm.server does, so a new
conversation with the same system prompt, or the next turn of this one,
starts from a cached prefix.
"""

from __future__ import annotations

import collections
import hashlib
import json
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from runtime.errors import ClientError
from runtime.harmony import harmony_effort, harmony_messages, is_harmony_tokenizer
from runtime.messages import PreparedPrompt, SegmentPlan
from runtime.mlx_lm_internals import convert_chat
from runtime.tokenizing import encode

RESERVED_TEMPLATE_ARGS = frozenset(
    {"tokenize", "return_dict", "return_tensors", "add_generation_prompt", "conversation",
     "messages", "tools", "continue_final_message"}
)


THINKING_TAIL_TOKENS = 11

# System prompts' tokens remembered per tokenizer (the most recent few): a coding
# agent's 10-20k-token system prompt is the same in every request of every session,
# and encoding it again took about as long as the rest of the prompt.
SYSTEM_PREFIXES_KEPT = 16
_system_prefixes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_system_prefixes_lock = threading.Lock()


def _remembered_system_prefix(tokenizer, key: tuple, compute: Callable[[], Any]):
    """``compute()`` (the system messages' rendering, encoded), remembered under ``key``."""
    with _system_prefixes_lock:
        try:
            kept = _system_prefixes.setdefault(tokenizer, collections.OrderedDict())
        except TypeError:  # a tokenizer that cannot be weakly referenced: no memory
            return compute()
        if key in kept:
            kept.move_to_end(key)
            return kept[key]
    value = compute()
    with _system_prefixes_lock:
        kept[key] = value
        while len(kept) > SYSTEM_PREFIXES_KEPT:
            kept.popitem(last=False)
    return value


# Prompts whose last message is one of these are split into segments. A coding
# agent's turn often ends with a tool result: its system prompt gets a cache
# entry of its own as a user turn's does.
SEGMENTED_ROLES = ("user", "tool")


def plan_segments(
    prompt: Sequence[int],
    *,
    last_role: str,
    system_prefix: Sequence[int] | None,
    think_start_at: Callable[[Sequence[int], int], int] | None,
) -> SegmentPlan:
    """Split a chat prompt into cacheable segments.

    ``system_prefix`` is the template rendered with only the system messages
    (and an empty user turn) or None; ``think_start_at(prompt, start)`` finds
    the last think-start token at or after ``start`` (-1 if none). Segment
    types order the cache's eviction: "assistant" first, then "user", then
    "system".
    """
    prompt = tuple(prompt)
    whole = SegmentPlan(segments=(prompt,), segment_types=("assistant",))
    if last_role not in SEGMENTED_ROLES or not prompt:
        return whole

    segments: list[tuple[int, ...]] = []
    types: list[str] = []
    sys_end = 0
    if system_prefix:
        for i, (a, b) in enumerate(zip(system_prefix, prompt, strict=False)):
            if a != b:
                sys_end = i
                break
        if 0 < sys_end < len(prompt):
            segments.append(prompt[:sys_end])
            types.append("system")

    tail_start = len(prompt)
    if think_start_at is not None:
        found = think_start_at(prompt, tail_start - THINKING_TAIL_TOKENS)
        if found >= 0:
            tail_start = max(found, sys_end)  # never overlap the system segment

    if sys_end < tail_start:
        segments.append(prompt[sys_end:tail_start])
        types.append("user")
    if tail_start < len(prompt):
        segments.append(prompt[tail_start:])
        types.append("assistant")
    if not segments:
        return whole
    return SegmentPlan(segments=tuple(segments), segment_types=tuple(types))



def template_key(template_args: Mapping[str, Any]) -> str:
    """A hash of everything besides the messages that shapes a chat prompt's tokens.

    ``template_args``: the keyword arguments the chat template is rendered
    with: the server's ``--chat-template-args`` overridden key by key by the
    request's ``chat_template_kwargs`` (reserved keys dropped), and ``tools``;
    for a model without a chat template, the ``role_mapping``."""
    return _digest(_canonical(dict(template_args)))


def conversation_keys(messages: Sequence[Mapping[str, Any]]) -> tuple[str, ...]:
    """One hash per message prefix (``keys[i]`` covers ``messages[: i + 1]``).

    A cache entry remembers the last key of the request that stored it; a later
    request whose keys include it continues (or repeats) that conversation."""
    keys, key = [], ""
    for message in messages:
        key = _digest(key, _canonical(dict(message)))
        keys.append(key)
    return tuple(keys)


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)


def _digest(*parts: str) -> str:
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        h.update(part.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return h.hexdigest()


def prepare_text(tokenizer, prompt: str | Sequence[int]) -> PreparedPrompt:
    tokens = tuple(prompt) if not isinstance(prompt, str) else tuple(encode(tokenizer, prompt))
    if not tokens:
        raise ClientError("prompt must not be empty", param="prompt")
    return PreparedPrompt(
        tokens=tokens, plan=SegmentPlan(segments=(tokens,), segment_types=("assistant",))
    )


def prepare_chat(
    tokenizer,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None,
    template_args: Mapping[str, Any],
    role_mapping: Mapping[str, str] | None = None,
    add_generation_prompt: bool = True,
) -> PreparedPrompt:
    """``add_generation_prompt=False``: the conversation alone (``POST /tokenize``)."""
    keys = conversation_keys(messages)
    if not getattr(tokenizer, "has_chat_template", False):
        tokens = tuple(encode(tokenizer, convert_chat(messages, role_mapping)))
        return PreparedPrompt(
            tokens=tokens,
            plan=SegmentPlan(segments=(tokens,), segment_types=("assistant",)),
            template_key=template_key({"role_mapping": dict(role_mapping or {})}),
            conversation_keys=keys,
        )

    # A client's chat_template_kwargs shape the rendering, never the call itself.
    kwargs = {k: v for k, v in template_args.items() if k not in RESERVED_TEMPLATE_ARGS}
    kwargs["tools"] = tools
    if is_harmony_tokenizer(tokenizer):  # gpt-oss: its template's shape and levels
        messages = harmony_messages(messages)
        if "reasoning_effort" in kwargs:
            kwargs["reasoning_effort"] = harmony_effort(kwargs["reasoning_effort"])
    try:
        rendered = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
        )
    except Exception as exc:  # templates raise on messages they cannot render
        raise ClientError(f"the chat template rejected the messages: {exc}", param="messages") from None
    # Rendered, then encoded as apply_chat_template(tokenize=True) does (no special
    # tokens added: the template wrote them), through the backend when it agrees.
    tokens = tuple(encode(tokenizer, rendered, add_special_tokens=False))

    initial_state = "normal"
    has_thinking = getattr(tokenizer, "has_thinking", False)
    if has_thinking and tokenizer.rfind_think_start(tokens) > tokenizer.rfind_think_end(tokens):
        initial_state = "reasoning"
    initial_state = getattr(tokenizer, "response_initial_state", None) or initial_state

    system_prefix = None
    n_system = 0
    for m in messages:
        if m["role"] != "system":
            break
        n_system += 1
    if n_system and messages[-1]["role"] in SEGMENTED_ROLES:

        def render_system() -> tuple[int, ...] | None:
            try:
                return tuple(encode(
                    tokenizer,
                    tokenizer.apply_chat_template(
                        messages[:n_system] + [{"role": "user", "content": ""}],
                        add_generation_prompt=False,
                        tokenize=False,
                        **kwargs,
                    ),
                    add_special_tokens=False,
                ))
            except Exception:
                return None

        system_prefix = _remembered_system_prefix(
            tokenizer, (template_key(kwargs), keys[n_system - 1]), render_system
        )

    def think_start_at(prompt, start):
        return tokenizer.rfind_think_start(list(prompt), start=start)

    plan = plan_segments(
        tokens,
        last_role=messages[-1]["role"],
        system_prefix=system_prefix,
        think_start_at=think_start_at if has_thinking else None,
    )
    return PreparedPrompt(
        tokens=tokens,
        plan=plan,
        initial_state=initial_state,
        template_key=template_key(kwargs),
        conversation_keys=keys,
    )


def prepare_vision_chat(
    tokenizer,
    processor,
    model_type: str,
    messages: list[dict[str, Any]],
    images: list,
    *,
    tools: list[dict[str, Any]] | None,
    template_args: Mapping[str, Any],
) -> PreparedPrompt:
    """A chat prompt with images, for a vision-language model (``runtime.vision``).

    The template renders one placeholder per ``{"type": "image"}`` part; mlx-vlm's
    processor expands each to its image's patch tokens and makes the image tensors
    (``PreparedPrompt.vision``). One segment: two images share their placeholder
    tokens, so a token prefix says nothing about the pixels behind it.
    """
    from runtime.vision import prepare_vision_prompt

    kwargs = {k: v for k, v in template_args.items() if k not in RESERVED_TEMPLATE_ARGS}
    kwargs["tools"] = tools
    try:
        rendered = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **kwargs
        )
    except Exception as exc:  # templates raise on messages they cannot render
        raise ClientError(f"the chat template rejected the messages: {exc}", param="messages") from None
    try:
        tokens, vision = prepare_vision_prompt(processor, model_type, rendered, images)
    except Exception as exc:  # the processor refuses what it cannot match or read
        param = images[0].param if images else "messages"
        raise ClientError(f"the model's processor rejected the images: {exc}", param=param) from None
    return PreparedPrompt(
        tokens=tokens,
        plan=SegmentPlan(segments=(tokens,), segment_types=("user",)),
        template_key=template_key(kwargs),
        conversation_keys=conversation_keys(messages),
        vision=vision,
    )
