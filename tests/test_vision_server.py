"""A vision-language model end to end: a real server, the official ``openai`` SDK, an image.

A tiny random Qwen2-VL built here (``runtime.tiny_vision_model``, nothing
downloaded) is served by a ``hypercorn api:app`` subprocess (engine in its
own process, the default), with ``--allow-image-urls``. A chat completion
with a ``data:`` URL image, or an ``http`` URL served on loopback, must answer,
streamed and not, exactly what ``mlx_vlm.generate`` gives for the same prompt
and image at temperature 0; a text-only request to the same model is served
too, and a client that leaves mid-stream frees the engine for the next.
"""

from __future__ import annotations

import base64
import contextlib
import http.server
import io
import os
import threading

import pytest

from runtime.tiny_vision_model import build_tiny_vision_model
from tests.test_server_process import hypercorn_args, spawn_server, stop_server

pytestmark = pytest.mark.server  # starts a hypercorn subprocess

openai = pytest.importorskip("openai")
pytest.importorskip("mlx_vlm")

PROMPT = "What is this?"
MAX_TOKENS = 8
# Seed 2's greedy answer decodes to the same text token by token and whole,
# so the two detokenizers (mlx-vlm's and the server's) have one right answer.
SEED = 2


@pytest.fixture(scope="module")
def vision_model(tmp_path_factory) -> str:
    return str(build_tiny_vision_model(tmp_path_factory.mktemp("tiny-vlm"), seed=SEED))


@pytest.fixture(scope="module")
def image_png() -> bytes:
    from PIL import Image

    image = Image.new("RGB", (60, 40), (200, 30, 40))
    for x in range(30):
        image.putpixel((x, x % 40), (10, 220, 90))
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def reference(vision_model, image_png, tmp_path_factory) -> str:
    """mlx-vlm's own answer: its chat template, its processor, greedy."""
    from mlx_vlm import generate, load
    from mlx_vlm.prompt_utils import apply_chat_template

    path = tmp_path_factory.mktemp("image") / "image.png"
    path.write_bytes(image_png)
    model, processor = load(vision_model)
    prompt = apply_chat_template(processor, model.config, PROMPT, num_images=1)
    result = generate(model, processor, prompt, image=[str(path)], max_tokens=MAX_TOKENS,
                      temperature=0.0)
    assert result.text, "the reference generated nothing"
    return result.text


@pytest.fixture(scope="module")
def image_server(image_png):
    """http://127.0.0.1:PORT/image.png serves the image; any other path a 404."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            found = self.path == "/image.png"
            self.send_response(200 if found else 404)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            if found:
                self.wfile.write(image_png)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def oai(vision_model):
    env = {"MLX_TRIO_MODEL": vision_model, "MLX_TRIO_MAX_TOKENS": "32",
           "MLX_TRIO_ALLOW_IMAGE_URLS": "true", "MLX_TRIO_IMAGE_MAX_BYTES": "100000",
           "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(
               p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)}
    proc, base = spawn_server(hypercorn_args, env)
    yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    stop_server(proc)


def _messages(image_png: bytes, url: str | None = None) -> list[dict]:
    url = url or "data:image/png;base64," + base64.b64encode(image_png).decode()
    # mlx-vlm's Qwen2-VL prompt puts the text first, then the image.
    return [{"role": "user", "content": [
        {"type": "text", "text": PROMPT},
        {"type": "image_url", "image_url": {"url": url}},
    ]}]


def test_image_answer_equals_mlx_vlm_generate(oai, image_png, reference):
    reply = oai.chat.completions.create(
        model="default_model", messages=_messages(image_png), temperature=0, max_tokens=MAX_TOKENS
    )
    assert reply.choices[0].message.content == reference
    # The image's patches are prompt tokens: far more than the text alone.
    text_only = oai.chat.completions.create(
        model="default_model", messages=[{"role": "user", "content": PROMPT}], temperature=0,
        max_tokens=1,
    )
    assert reply.usage.prompt_tokens > text_only.usage.prompt_tokens + 3


def test_image_answer_streamed_equals_mlx_vlm_generate(oai, image_png, reference):
    stream = oai.chat.completions.create(
        model="default_model", messages=_messages(image_png), temperature=0,
        max_tokens=MAX_TOKENS, stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == reference


def test_bad_image_is_a_400_naming_the_part(oai):
    messages = [{"role": "user", "content": [
        {"type": "text", "text": PROMPT},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}},
    ]}]
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="default_model", messages=messages, max_tokens=2)
    assert info.value.body["param"] == "messages[0].content[1]"
    assert "could not be decoded" in info.value.body["message"]


def test_an_http_image_url_is_fetched_when_allowed(oai, image_png, image_server, reference):
    reply = oai.chat.completions.create(
        model="default_model", messages=_messages(image_png, f"{image_server}/image.png"),
        temperature=0, max_tokens=MAX_TOKENS,
    )
    assert reply.choices[0].message.content == reference
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(
            model="default_model", messages=_messages(image_png, f"{image_server}/missing.png"),
            max_tokens=2,
        )
    assert info.value.body["param"] == "messages[0].content[1]"
    assert "HTTP 404" in info.value.body["message"]


def test_an_image_over_the_byte_limit_is_a_400(oai):
    big = base64.b64encode(b"x" * 100_001).decode()
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(
            model="default_model", max_tokens=2,
            messages=_messages(b"", f"data:image/png;base64,{big}"),
        )
    assert info.value.body["param"] == "messages[0].content[1]"
    assert "larger than 100000 bytes" in info.value.body["message"]


def test_logprobs_and_several_choices_with_an_image(oai, image_png, reference):
    reply = oai.chat.completions.create(
        model="default_model", messages=_messages(image_png), temperature=0,
        max_tokens=MAX_TOKENS, n=2, logprobs=True, top_logprobs=2,
    )
    assert [c.message.content for c in reply.choices] == [reference, reference]
    tokens = reply.choices[0].logprobs.content
    assert len(tokens) == reply.usage.completion_tokens // 2
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in tokens)


def test_a_client_leaving_mid_stream_frees_the_engine(oai, image_png, reference):
    stream = oai.chat.completions.create(
        model="default_model", messages=_messages(image_png), temperature=0, max_tokens=30,
        stream=True,
    )
    with contextlib.closing(stream):
        next(iter(stream))
    reply = oai.chat.completions.create(
        model="default_model", messages=_messages(image_png), temperature=0, max_tokens=MAX_TOKENS
    )
    assert reply.choices[0].message.content == reference
