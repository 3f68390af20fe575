"""Turning a validated request into prompt tokens (no MLX: any thread).

Receives plain chat messages (content already a string, tool-call arguments
already objects) or a text prompt; returns a ``PreparedPrompt`` with the
tokens, the prompt cache's segment plan, and the text state the model starts
in (inside a thinking block or not). Runs in a worker thread
(``trio.to_thread``) because chat templates and tokenizers are slow Python.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from actors.prompt_cache import SegmentPlan, plan_segments
from runtime.errors import ClientError
from runtime.mlx_lm_internals import convert_chat

RESERVED_TEMPLATE_ARGS = frozenset(
    {"tokenize", "return_dict", "return_tensors", "add_generation_prompt", "conversation",
     "messages", "tools", "continue_final_message"}
)


@attrs.frozen(kw_only=True)
class PreparedPrompt:
    tokens: tuple[int, ...]
    plan: SegmentPlan
    initial_state: str = "normal"


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
) -> PreparedPrompt:
    if not getattr(tokenizer, "has_chat_template", False):
        tokens = tuple(tokenizer.encode(convert_chat(messages, role_mapping)))
        return PreparedPrompt(
            tokens=tokens, plan=SegmentPlan(segments=(tokens,), segment_types=("assistant",))
        )

    # A client's chat_template_kwargs shape the rendering, never the call itself.
    kwargs = {k: v for k, v in template_args.items() if k not in RESERVED_TEMPLATE_ARGS}
    kwargs["tools"] = tools
    try:
        tokens = tuple(tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs))
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
