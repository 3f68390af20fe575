"""Images in requests: image_url parts decoded or refused, each refusal a 400 naming the part.

``api.images`` on its own (data: URLs, size and pixel bounds, http(s) only
when allowed), then a text-only model served in-process: an image part in a
chat completion, a Responses input or a Messages request is a 400 whose
``param`` is the content part.
"""

from __future__ import annotations

import base64
import io

import pytest
import trio

from api.images import ImageRef, image_refs, load_images
from api.schemas import ChatMessage, ContentPart, ImageUrlIn
from runtime.config import ServerConfig
from runtime.errors import ClientError


def _png(width: int = 8, height: int = 6) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), (1, 2, 3)).save(out, "PNG")
    return out.getvalue()


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


PART = "messages[0].content[1]"


async def _load(url: str, **settings):
    return await load_images([ImageRef(PART, url)], ServerConfig(**settings))


async def test_a_data_url_decodes_to_rgb_pixels():
    (image,) = await _load(_data_url(_png(8, 6)))
    assert image.param == PART
    assert image.image.size == (8, 6)
    assert image.image.mode == "RGB"


@pytest.mark.parametrize(
    ("url", "settings", "words"),
    [
        (_data_url(_png(40, 40)), {"image_max_bytes": 50}, "larger than 50 bytes"),
        (_data_url(_png(40, 40)), {"image_max_pixels": 1599}, "40 x 40 pixels"),
        ("data:image/png;base64,@@not base64@@", {}, "not valid base64"),
        (_data_url(b"plain text, not an image"), {}, "could not be decoded"),
        ("data:text/plain,hello", {}, "data:image/<type>;base64"),
        ("http://127.0.0.1:9/cat.png", {}, "--allow-image-urls is off"),
        ("ftp://example.com/cat.png", {}, "data: URL (base64) or an http(s) URL"),
    ],
)
async def test_refusals_name_the_part(url, settings, words):
    with pytest.raises(ClientError) as info:
        await _load(url, **settings)
    assert info.value.param == PART
    assert words in str(info.value)


async def test_an_unreachable_url_is_a_400_when_fetching_is_allowed():
    with pytest.raises(ClientError) as info:
        await _load("http://127.0.0.1:9/cat.png", allow_image_urls=True, image_fetch_timeout=5)
    assert info.value.param == PART
    assert "could not be fetched" in str(info.value)


async def test_a_slow_fetch_is_cut_at_the_timeout(monkeypatch):
    import httpx

    async def never_answers(self, request, **options):
        await trio.sleep_forever()

    monkeypatch.setattr(httpx.AsyncClient, "send", never_answers)
    with trio.fail_after(5):
        with pytest.raises(ClientError) as info:
            await _load("https://example.com/cat.png", allow_image_urls=True,
                        image_fetch_timeout=0.05)
    assert "longer than 0.05 s" in str(info.value)


async def test_a_fetched_image_is_bounded_by_image_max_bytes(monkeypatch):
    import httpx

    png = _png(8, 6)
    fetched = []

    async def answer(self, request, **options):
        fetched.append(str(request.url))
        return httpx.Response(200, content=png, request=request)

    monkeypatch.setattr(httpx.AsyncClient, "send", answer)
    (image,) = await _load("https://example.com/cat.png", allow_image_urls=True)
    assert image.image.size == (8, 6)
    assert fetched == ["https://example.com/cat.png"]
    with pytest.raises(ClientError) as info:
        await _load("https://example.com/cat.png", allow_image_urls=True,
                    image_max_bytes=len(png) - 1)
    assert f"larger than {len(png) - 1} bytes" in str(info.value)


def test_image_refs_are_found_in_order_and_need_a_url():
    messages = [
        ChatMessage(role="user", content="plain"),
        ChatMessage(role="user", content=[
            ContentPart(type="text", text="look"),
            ContentPart(type="image_url", image_url=ImageUrlIn(url="data:a")),
            ContentPart(type="image_url", image_url=ImageUrlIn(url="data:b")),
        ]),
    ]
    assert image_refs(messages) == [
        ImageRef("messages[1].content[1]", "data:a"),
        ImageRef("messages[1].content[2]", "data:b"),
    ]
    with pytest.raises(ClientError) as info:
        image_refs([ChatMessage(role="user", content=[ContentPart(type="image_url")])])
    assert info.value.param == "messages[0].content[0].image_url"


# ------------------------------------------------ a text-only model, served


def _image_part() -> dict:
    return {"type": "image_url", "image_url": {"url": _data_url(_png())}}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, _image_part()]}]},
         "messages[0].content[1]"),
        ("/v1/chat/completions",
         {"messages": [{"role": "system", "content": "be brief"},
                       {"role": "user", "content": [_image_part()]}], "stream": True},
         "messages[1].content[0]"),
        ("/tokenize",
         {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, _image_part()]}]},
         "messages[0].content[1]"),
        ("/v1/responses",
         {"input": [{"role": "user", "content": [
             {"type": "input_text", "text": "hi"},
             {"type": "input_image", "image_url": _data_url(_png())}]}]},
         "input[0].content[1]"),
        ("/v1/messages",
         {"max_tokens": 4, "messages": [{"role": "user", "content": [
             {"type": "text", "text": "hi"},
             {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                          "data": base64.b64encode(_png()).decode()}}]}]},
         "messages[0].content[1]"),
    ],
)
async def test_a_text_only_model_refuses_images_naming_the_part(client, path, body, param):
    response = await client.post(path, json={"model": "default_model", **body})
    data = await response.get_json()
    assert response.status_code == 400, data
    if path != "/v1/messages":  # Anthropic's error shape has no param; its message names it
        assert data["error"]["param"] == param
    assert data["error"]["message"].startswith(param)


async def test_the_text_only_refusal_says_why_and_text_still_works(client):
    body = {"model": "default_model", "max_tokens": 2,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, _image_part()]}]}
    response = await client.post("/v1/chat/completions", json=body)
    message = (await response.get_json())["error"]["message"]
    assert "needs a vision-language model" in message and "text-only" in message
    body["messages"][0]["content"] = [{"type": "text", "text": "hi"}, {"type": "text", "text": "!"}]
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
