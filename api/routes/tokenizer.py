"""``POST /tokenize`` and ``POST /detokenize``: the served model's tokenizer, as vLLM and
llama.cpp offer it.

``/tokenize`` receives ``{"model"?, "prompt": str, "add_special_tokens"?}`` (the
text encoded as ``/v1/completions`` encodes it) or ``{"model"?, "messages":
[...], "add_generation_prompt"?, "tools"?, "chat_template_kwargs"?}`` (the
chat template applied as ``/v1/chat/completions`` applies it, with the
server's ``--chat-template-args`` under the request's) and emits ``{"tokens":
[...], "count": n}``, plus ``"max_model_len"`` when the model's config states
its context length. ``/detokenize`` receives ``{"model"?, "tokens": [...]}``
and emits ``{"prompt": str}`` (special tokens kept as text).

The model is leased for the call (``Runtime.acquire``: it may have to load) and
the tokenizer runs in a worker thread under the runtime's tokenizer limiter,
never on the event loop. Errors are 400s naming the field (``prompt``,
``messages[0].role``, ``tokens[3]``); a model that is not served is a 404.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import trio
from quart import Blueprint

from actors.system import Runtime
from api.convert import structure_or_400
from api.http import json_response, read_json
from api.images import image_refs
from api.routes.completions import plain_message
from api.schemas import DetokenizeRequest, TokenizeRequest
from runtime.config import ServerConfig
from runtime.errors import ClientError
from runtime.models import ModelKey, context_length
from runtime.prompts import prepare_chat


def tokenizer_blueprint(rt: Runtime, config: ServerConfig) -> Blueprint:
    routes = Blueprint("tokenizer", __name__)

    @routes.post("/tokenize")
    async def tokenize():
        req = structure_or_400(await read_json(), TokenizeRequest)
        if (req.prompt is None) == (req.messages is None):
            raise ClientError(
                "send either 'prompt' (text) or 'messages' (a chat), not both",
                param="prompt" if req.prompt is None else "messages",
            )
        if req.messages is not None:
            refs = image_refs(req.messages)
            if refs:
                raise ClientError(
                    f"{refs[0].param}: /tokenize counts text only (an image's tokens depend on "
                    "the model's processor and the image's size)",
                    param=refs[0].param,
                )
            work = functools.partial(
                _chat_tokens,
                messages=[plain_message(m, f"messages[{i}]") for i, m in enumerate(req.messages)],
                tools=req.tools,
                template_args={**config.chat_template_args, **(req.chat_template_kwargs or {})},
                add_generation_prompt=req.add_generation_prompt,
            )
        else:
            work = functools.partial(
                _text_tokens, prompt=req.prompt, add_special_tokens=req.add_special_tokens
            )
        key = await rt.resolve(req.model)
        tokens = await _with_tokenizer(rt, key, work)
        body: dict[str, Any] = {"tokens": tokens, "count": len(tokens)}
        max_len = await trio.to_thread.run_sync(context_length, key.model)
        if max_len is not None:
            body["max_model_len"] = max_len
        return json_response(body)

    @routes.post("/detokenize")
    async def detokenize():
        req = structure_or_400(await read_json(), DetokenizeRequest)
        key = await rt.resolve(req.model)
        text = await _with_tokenizer(rt, key, functools.partial(_text_of, tokens=req.tokens))
        return json_response({"prompt": text})

    return routes


async def _with_tokenizer(rt: Runtime, key: ModelKey, work: Callable[..., Any]) -> Any:
    """``work(tokenizer, vocab_size)`` in a worker thread, with ``key`` leased meanwhile."""
    handle = await rt.acquire(key)
    try:
        return await trio.to_thread.run_sync(
            work, handle.tokenizer, handle.info.vocab_size, limiter=rt.tokenize_limiter
        )
    finally:
        rt.release()


def _text_tokens(tokenizer, vocab_size: int, *, prompt: str, add_special_tokens: bool) -> list[int]:
    return list(tokenizer.encode(prompt, add_special_tokens=add_special_tokens))


def _chat_tokens(
    tokenizer, vocab_size: int, *, messages, tools, template_args, add_generation_prompt
) -> list[int]:
    prepared = prepare_chat(
        tokenizer,
        messages,
        tools=tools,
        template_args=template_args,
        add_generation_prompt=add_generation_prompt,
    )
    return list(prepared.tokens)


def _text_of(tokenizer, vocab_size: int, *, tokens: list[int]) -> str:
    for i, token in enumerate(tokens):
        if not 0 <= token < vocab_size:
            raise ClientError(
                f"tokens[{i}] = {token} is outside the vocabulary (0..{vocab_size - 1})",
                param=f"tokens[{i}]",
            )
    try:
        return tokenizer.decode(tokens)
    except Exception as exc:  # an id the model has but its tokenizer does not
        raise ClientError(f"the tokens cannot be decoded: {exc}", param="tokens") from None
