"""``POST /v1/chat/completions`` and ``POST /v1/completions`` (and their unversioned aliases).

Receives the request body, structured and validated at the edge
(``api.schemas``, 400 naming the field); collects a chat request's
``image_url`` parts (``api.images``: fetched and decoded only once the
Session knows the model is a vision-language model); resolves the model (404) in a worker
thread; builds a ``Session`` (prompt preparation, sampling, limits, and for
chat the constraint of ``response_format`` / ``tool_choice``) and hands
it to ``api.generation.generate`` with the chat or text renderer. Emits the
OpenAI chat / text completion body or its SSE stream.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from quart import Blueprint

from actors.system import Runtime
from api.cache_scope import prompt_cache_scope
from api.choices import ChoicesRenderer
from api.convert import structure_or_400
from api.generation import deadline, effort_template_args, generate, sampling_params
from api.http import fingerprint, read_json, small_body
from api.images import image_refs, load_images
from api.json_input import loads as load_json
from api.renderers import ChatRenderer, TextRenderer
from api.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, GenerationFields
from api.structured import constrain_step
from runtime.config import ServerConfig
from runtime.errors import ClientError
from runtime.prompts import prepare_chat, prepare_text, prepare_vision_chat


def plain_message(message: ChatMessage, where: str = "messages") -> dict[str, Any]:
    """A validated message as the chat template expects it (``where``: its path, for 400s)."""
    content = message.content
    if isinstance(content, list):
        for k, part in enumerate(content):
            if part.type == "text" and part.text is None:
                at = f"{where}.content[{k}].text"
                raise ClientError(f"{at}: a text content part needs 'text'", param=at)
        if any(part.type == "image_url" for part in content):
            # The template renders a placeholder for each image, where the client put it.
            content = [
                {"type": "image"} if part.type == "image_url" else {"type": "text", "text": part.text}
                for part in content
            ]
        else:
            content = "".join(part.text for part in content)
    out: dict[str, Any] = {"role": message.role, "content": content or ""}
    if message.name is not None:
        out["name"] = message.name
    reasoning = message.reasoning_content or message.reasoning
    if reasoning and message.role == "assistant":  # a past turn's thinking, as templates read it
        out["reasoning_content"] = reasoning
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        calls = []
        for j, call in enumerate(message.tool_calls):
            arguments = call.function.arguments
            if isinstance(arguments, str):
                param = f"{where}.tool_calls[{j}].function.arguments"
                try:
                    arguments = load_json(arguments, where=param) if arguments.strip() else {}
                except json.JSONDecodeError:
                    raise ClientError(
                        "tool call arguments must be a JSON object", param=param
                    ) from None
            calls.append(
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": arguments},
                }
            )
        out["tool_calls"] = calls
    return out


def completions_blueprint(rt: Runtime, config: ServerConfig) -> Blueprint:
    routes = Blueprint("completions", __name__)
    system_fingerprint = fingerprint()

    @routes.post("/v1/chat/completions")
    @routes.post("/chat/completions")
    async def chat_completions():
        req = structure_or_400(await read_json(), ChatCompletionRequest)
        messages = [plain_message(m, f"messages[{i}]") for i, m in enumerate(req.messages)]
        template_args = {
            **config.chat_template_args,
            **effort_template_args(req.reasoning_effort),
            **(req.chat_template_kwargs or {}),
        }
        prepare = functools.partial(
            _prepare_chat,
            messages=messages,
            tools=req.tools,
            template_args=template_args,
            role_mapping=req.role_mapping,
        )
        constrain = constrain_step(
            response_format=req.response_format,
            tools=req.tools,
            tool_choice=req.tool_choice,
            parallel_tool_calls=req.parallel_tool_calls,
            template_args=template_args,
        )
        want_logprobs = req.logprobs or bool(req.top_logprobs)
        images = image_refs(req.messages)
        return await serve(
            req,
            ChatRenderer,
            prepare,
            markup=True,
            tools=req.tools,
            logprobs=want_logprobs,
            top_logprobs=req.top_logprobs or 0,
            constrain=constrain,
            prompt_param="messages",
            images=images,
        )

    @routes.post("/v1/completions")
    @routes.post("/completions")
    async def completions():
        req = structure_or_400(await read_json(), CompletionRequest)
        form = req.logprobs_form
        return await serve(
            req,
            functools.partial(TextRenderer, logprobs_form=form or "legacy"),
            functools.partial(_prepare_text, prompt=req.prompt),
            markup=False,
            logprobs=form is not None,
            top_logprobs=req.top_logprobs_wanted,
            prompt_param="prompt",
        )

    async def serve(
        req: GenerationFields,
        renderer_class,
        prepare,
        *,
        markup,
        logprobs,
        top_logprobs,
        prompt_param,
        tools=None,
        constrain=None,
        images=(),
    ):
        """The part of a chat or text completion that does not depend on which."""
        if req.n > config.max_choices:
            raise ClientError(
                f"n must be at most {config.max_choices} (the server's --max-choices)", param="n"
            )
        key = await rt.resolve(req.model, req.adapters, req.draft_model)
        session = rt.session(
            prepare=prepare,
            sampling=sampling_params(req, config),
            max_tokens=req.token_limit or config.max_tokens,
            stop=req.stop_strings,
            tools=tools,
            markup=markup,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            timeout=deadline(req.timeout, config),
            model=key,
            num_draft_tokens=req.num_draft_tokens,
            constrain=constrain,
            n=req.n,
            prompt_param=prompt_param,
            prepare_inline=small_body(),
            cache_scope=prompt_cache_scope(config, req.cache_salt),
            image_params=tuple(ref.param for ref in images),
            load_images=functools.partial(load_images, images, config) if images else None,
        )
        make_renderer = functools.partial(
            renderer_class,
            # The id /v1/models lists for the served model, whatever alias named it.
            model=rt.model_id if key == rt.default_model else req.model,
            fingerprint=system_fingerprint,
            logprobs=logprobs,
        )
        if req.n == 1:
            renderer = make_renderer(include_usage=req.include_usage)
        else:
            renderer = ChoicesRenderer(
                functools.partial(make_renderer, include_usage=False),
                req.n,
                include_usage=req.include_usage,
            )
        return await generate(
            session, renderer, req.stream, stream_interval=config.stream_interval_ms / 1000
        )

    return routes


def _prepare_chat(tokenizer, *, messages, tools, template_args, role_mapping, vision=None):
    if vision is not None:
        processor, model_type, images = vision
        return prepare_vision_chat(
            tokenizer, processor, model_type, messages, list(images),
            tools=tools, template_args=template_args,
        )
    return prepare_chat(
        tokenizer, messages, tools=tools, template_args=template_args, role_mapping=role_mapping
    )


def _prepare_text(tokenizer, *, prompt):
    return prepare_text(tokenizer, prompt)
