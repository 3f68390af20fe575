"""Turning a validated request into prompt tokens (no MLX: any thread).

Receives plain chat messages (content already a string, tool-call arguments
already objects) or a text prompt; returns a ``PreparedPrompt`` with the
tokens, the prompt cache's segment plan, and the text state the model starts
in (inside a thinking block or not). Runs in a worker thread
(``trio.to_thread``) because chat templates and tokenizers are slow Python.

``plan_segments`` is the segmentation policy: where in a chat prompt the
engine keeps a copy of the KV cache (end of the system prompt, end of the
conversation before a thinking tail), as mlx_lm.server does, so a new
conversation with the same system prompt, or the next turn of this one,
starts from a cached prefix.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from runtime.errors import ClientError
from runtime.messages import PreparedPrompt, SegmentPlan
from runtime.mlx_lm_internals import convert_chat

RESERVED_TEMPLATE_ARGS = frozenset(
    {"tokenize", "return_dict", "return_tensors", "add_generation_prompt", "conversation",
     "messages", "tools", "continue_final_message"}
)


THINKING_TAIL_TOKENS = 11


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
    if last_role != "user" or not prompt:
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



def prepare_text(tokenizer, prompt: str | Sequence[int]) -> PreparedPrompt:
    tokens = tuple(prompt) if not isinstance(prompt, str) else tuple(tokenizer.encode(prompt))
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
    if not getattr(tokenizer, "has_chat_template", False):
        tokens = tuple(tokenizer.encode(convert_chat(messages, role_mapping)))
        return PreparedPrompt(
            tokens=tokens, plan=SegmentPlan(segments=(tokens,), segment_types=("assistant",))
        )

    # A client's chat_template_kwargs shape the rendering, never the call itself.
    kwargs = {k: v for k, v in template_args.items() if k not in RESERVED_TEMPLATE_ARGS}
    kwargs["tools"] = tools
    try:
        tokens = tuple(
            tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, **kwargs
            )
        )
    except Exception as exc:  # templates raise on messages they cannot render
        raise ClientError(f"the chat template rejected the messages: {exc}", param="messages") from None

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
    if n_system and messages[-1]["role"] == "user":
        try:
            system_prefix = tokenizer.apply_chat_template(
                messages[:n_system] + [{"role": "user", "content": ""}],
                add_generation_prompt=False,
                **kwargs,
            )
        except Exception:
            system_prefix = None

    def think_start_at(prompt, start):
        return tokenizer.rfind_think_start(list(prompt), start=start)

    plan = plan_segments(
        tokens,
        last_role=messages[-1]["role"],
        system_prefix=system_prefix,
        think_start_at=think_start_at if has_thinking else None,
    )
    return PreparedPrompt(tokens=tokens, plan=plan, initial_state=initial_state)
