"""A vision-language model end to end: a real server, the official ``openai`` SDK, an image.

A tiny random Qwen2-VL built here (``runtime.tiny_vision_model``, nothing
downloaded) is served by a ``hypercorn api:app`` subprocess (engine in its
own process, the default). A chat completion with a ``data:`` URL image must
answer, streamed and not, exactly what ``mlx_vlm.generate`` gives for the same
prompt and image at temperature 0; a text-only request to the same model is
served too.
"""

from __future__ import annotations

import base64
import io
import os

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
def oai(vision_model):
    env = {"MLX_TRIO_MODEL": vision_model, "MLX_TRIO_MAX_TOKENS": "32",
           "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(
               p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)}
    proc, base = spawn_server(hypercorn_args, env)
    yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    stop_server(proc)


def _messages(image_png: bytes) -> list[dict]:
    url = "data:image/png;base64," + base64.b64encode(image_png).decode()
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
