"""Images in chat messages: ``image_url`` content parts -> decoded images.

Receives a chat request's messages (``api.schemas.ChatMessage``) and the
server's settings; emits the ``ImageRef``s the request names (the content
part's path and its URL) and, for a vision-language model, the decoded
images (``runtime.vision.ImageInput``: RGB PIL images, each with its part's
path). ``data:image/...;base64,`` URLs are always accepted, within
``image_max_bytes``; ``http(s)`` URLs only with ``allow_image_urls``, fetched
with httpx within ``image_max_bytes`` and ``image_fetch_timeout``, awaited on
the event loop (never blocking it). Pixel decoding runs in a worker thread and
refuses images over ``image_max_pixels``. Every refusal is a 400 naming the
content part (``messages[0].content[1]``).
"""

from __future__ import annotations

import base64
import binascii
import io
import logging
import re

import attrs
import trio

from runtime.config import ServerConfig
from runtime.errors import ClientError
from runtime.vision import ImageInput

log = logging.getLogger(__name__)

DATA_URL = re.compile(r"data:(?P<mime>image/[A-Za-z0-9.+-]+)?(?P<params>(;[^,;]*)*?);base64,", re.I)


@attrs.frozen
class ImageRef:
    """An ``image_url`` content part: where it is in the request, and its URL."""

    param: str  # e.g. "messages[0].content[1]"
    url: str


def image_refs(messages) -> list[ImageRef]:
    """Every ``image_url`` part of the messages, in order (400 for one without a URL)."""
    refs = []
    for i, message in enumerate(messages):
        if not isinstance(message.content, list):
            continue
        for k, part in enumerate(message.content):
            if part.type != "image_url":
                continue
            param = f"messages[{i}].content[{k}]"
            if part.image_url is None or not part.image_url.url:
                raise ClientError(
                    f"{param}.image_url: an image_url part needs 'image_url.url'",
                    param=f"{param}.image_url",
                )
            refs.append(ImageRef(param, part.image_url.url))
    return refs


def text_only_refusal(ref: ImageRef, model: str) -> ClientError:
    return ClientError(
        f"{ref.param}: an image content part needs a vision-language model; "
        f"the model {model!r} is text-only",
        param=ref.param,
    )


async def load_images(refs: list[ImageRef], config: ServerConfig) -> tuple[ImageInput, ...]:
    """Each part's image, fetched or decoded from its URL and then decoded to RGB pixels."""
    images = []
    for ref in refs:
        data = await _image_bytes(ref, config)
        image = await trio.to_thread.run_sync(_decode, ref, data, config.image_max_pixels)
        images.append(ImageInput(param=ref.param, image=image))
    return tuple(images)


async def _image_bytes(ref: ImageRef, config: ServerConfig) -> bytes:
    url = ref.url.strip()
    scheme = url.split(":", 1)[0].lower()
    if scheme == "data":
        return _data_url_bytes(ref, url, config.image_max_bytes)
    if scheme in ("http", "https"):
        if not config.allow_image_urls:
            raise ClientError(
                f"{ref.param}: http(s) image URLs are not fetched by this server "
                "(--allow-image-urls is off); send the image as a data: URL",
                param=ref.param,
            )
        return await _fetch(ref, url, config)
    raise ClientError(
        f"{ref.param}: the image URL must be a data: URL (base64) or an http(s) URL",
        param=ref.param,
    )


def _data_url_bytes(ref: ImageRef, url: str, max_bytes: int) -> bytes:
    match = DATA_URL.match(url)
    if match is None:
        raise ClientError(
            f"{ref.param}: a data: URL must be data:image/<type>;base64,<data>", param=ref.param
        )
    payload = url[match.end():]
    # base64 holds 3 bytes in every 4 characters: refuse before decoding
    if (len(payload) * 3) // 4 > max_bytes + 2:
        raise ClientError(
            f"{ref.param}: the image is larger than {max_bytes} bytes (--image-max-bytes)",
            param=ref.param,
        )
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ClientError(f"{ref.param}: the data: URL is not valid base64", param=ref.param) from None
    if len(data) > max_bytes:
        raise ClientError(
            f"{ref.param}: the image is larger than {max_bytes} bytes (--image-max-bytes)",
            param=ref.param,
        )
    return data


async def _fetch(ref: ImageRef, url: str, config: ServerConfig) -> bytes:
    import httpx

    max_bytes = config.image_max_bytes
    chunks: list[bytes] = []
    size = 0
    try:
        with trio.fail_after(config.image_fetch_timeout):
            async with httpx.AsyncClient(follow_redirects=True, max_redirects=3) as client:
                async with client.stream("GET", url) as response:
                    if response.status_code != 200:
                        raise ClientError(
                            f"{ref.param}: fetching the image gave HTTP {response.status_code}",
                            param=ref.param,
                        )
                    async for chunk in response.aiter_bytes():
                        size += len(chunk)
                        if size > max_bytes:
                            raise ClientError(
                                f"{ref.param}: the image is larger than {max_bytes} bytes "
                                "(--image-max-bytes)",
                                param=ref.param,
                            )
                        chunks.append(chunk)
    except trio.TooSlowError:
        raise ClientError(
            f"{ref.param}: fetching the image took longer than {config.image_fetch_timeout} s "
            "(--image-fetch-timeout)",
            param=ref.param,
        ) from None
    except httpx.HTTPError as exc:
        raise ClientError(f"{ref.param}: the image could not be fetched ({exc})", param=ref.param) from None
    return b"".join(chunks)


def _decode(ref: ImageRef, data: bytes, max_pixels: int):
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))  # reads the header only
        width, height = image.size
        if width * height > max_pixels:
            raise ClientError(
                f"{ref.param}: the image has {width} x {height} pixels, more than "
                f"{max_pixels} (--image-max-pixels)",
                param=ref.param,
            )
        return image.convert("RGB")
    except ClientError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise ClientError(f"{ref.param}: the image could not be decoded ({exc})", param=ref.param) from None
