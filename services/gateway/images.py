"""Images in chat requests: ``image_url`` parts checked, decoded and named at the door.

Each part's URL is a ``data:`` URL (PNG, JPEG or WebP, base64) or, only when
``gateway.images.fetch_hosts`` lists its host, an ``http(s)`` URL fetched with a
timeout and a size cap. Every check is a 400 naming the part
(``messages[i].content[j]``): bytes per image, images per request, the MIME type,
the header's dimensions (read before any pixel is decoded, so a decompression bomb
costs nothing), then a full decode (truncated or corrupt data). What passes is a
``CheckedImage``: the file's bytes as sent (the worker decodes them again) and their
hash, which names the image in the encoder-output and prefix caches.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import io
import warnings
from dataclasses import dataclass
from urllib.parse import urlsplit

from services.config import ImagesConfig
from services.engine.messages import ImageInput
from services.engine.placeholders import ImagePromptSpec, expand_image_tokens, image_offsets
from services.engine.tokenizer import Tokenizer
from services.gateway.errors import BadRequest
from services.gateway.protocol import ChatCompletionRequest
from services.gateway.tokens import chat_prompt_ids

__all__ = ["CheckedImage", "chat_prompt", "check_images", "image_inputs"]

# MIME type -> the format PIL must find in the bytes
_FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP"}


@dataclass(frozen=True, slots=True)
class CheckedImage:
    data: bytes
    content_hash: str  # sha256 of data, hex
    width: int
    height: int


async def chat_prompt(
    body: ChatCompletionRequest,
    tokenizer: Tokenizer,
    spec: ImagePromptSpec | None,
    config: ImagesConfig,
) -> tuple[tuple[int, ...], tuple[ImageInput, ...]]:
    """A chat request's prompt token ids (placeholders expanded) and its images."""
    urls = body.image_urls()
    if not urls:
        return chat_prompt_ids(tokenizer, body.chat_messages(), body.template_tools()), ()
    if spec is None:
        raise BadRequest("this model does not accept images", "messages")
    checked = await check_images(urls, config)
    raw = chat_prompt_ids(tokenizer, body.chat_messages(keep_images=True), body.template_tools())
    prompt = tuple(expand_image_tokens(raw, spec.image_token_id, spec.num_image_tokens))
    return prompt, image_inputs(prompt, checked, spec.image_token_id, spec.num_image_tokens)


async def check_images(urls: list[tuple[str, str]], config: ImagesConfig) -> list[CheckedImage]:
    """``(param, url)`` per image part, in prompt order -> checked images; BadRequest otherwise."""
    if len(urls) > config.max_images_per_request:
        raise BadRequest(
            f"{len(urls)} images; at most {config.max_images_per_request} per request "
            "(gateway.images.max_images_per_request)",
            "messages",
        )
    checked = []
    for param, url in urls:
        data, mime = await _fetch(param, url, config)
        # Decoding is CPU work: off the event loop.
        checked.append(await asyncio.to_thread(_check, param, data, mime, config))
    return checked


def image_inputs(
    prompt: tuple[int, ...], images: list[CheckedImage], image_token_id: int, per_image: int
) -> tuple[ImageInput, ...]:
    """The engine's ImageInputs for an expanded prompt; BadRequest if the template lost one."""
    offsets = image_offsets(prompt, image_token_id, per_image)
    if len(offsets) != len(images):
        raise BadRequest(
            f"the chat template placed {len(offsets)} image placeholders for {len(images)} images",
            "messages",
        )
    return tuple(
        ImageInput(image.content_hash, offset, per_image, data=image.data)
        for offset, image in zip(offsets, images)
    )


async def _fetch(param: str, url: str, config: ImagesConfig) -> tuple[bytes, str]:
    if url.startswith("data:"):
        return _from_data_url(param, url, config)
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise BadRequest(f"{param}: image URLs must be data: or http(s) URLs", param)
    if not config.fetch_hosts:
        raise BadRequest(
            f"{param}: fetching remote images is off on this server; send a data: URL "
            "(gateway.images.fetch_hosts)",
            param,
        )
    if parts.hostname not in config.fetch_hosts:
        raise BadRequest(f"{param}: host {parts.hostname!r} is not allowed for images", param)
    return await _download(param, url, config)


async def _download(param: str, url: str, config: ImagesConfig) -> tuple[bytes, str]:
    import httpx

    try:
        async with (
            httpx.AsyncClient(timeout=config.fetch_timeout_s, follow_redirects=False) as client,
            client.stream("GET", url) as response,
        ):
            if response.status_code != 200:
                raise BadRequest(
                    f"{param}: fetching the image gave HTTP {response.status_code}", param
                )
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > config.max_image_bytes:
                    raise BadRequest(_too_many_bytes(param, config), param)
            mime = response.headers.get("content-type", "").split(";")[0].strip().lower()
    except httpx.HTTPError as e:
        raise BadRequest(f"{param}: cannot fetch the image: {type(e).__name__}", param) from e
    return bytes(body), mime


def _from_data_url(param: str, url: str, config: ImagesConfig) -> tuple[bytes, str]:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise BadRequest(f"{param}: expected data:<image type>;base64,<data>", param)
    mime = header.removeprefix("data:").removesuffix(";base64").strip().lower()
    if mime not in _FORMATS:
        raise BadRequest(_bad_mime(param, mime), param)
    if len(payload) * 3 // 4 > config.max_image_bytes + 3:  # before decoding a byte
        raise BadRequest(_too_many_bytes(param, config), param)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise BadRequest(f"{param}: the image is not valid base64", param) from e
    if len(data) > config.max_image_bytes:
        raise BadRequest(_too_many_bytes(param, config), param)
    return data, mime


def _check(param: str, data: bytes, mime: str, config: ImagesConfig) -> CheckedImage:
    from PIL import Image, UnidentifiedImageError

    if mime not in _FORMATS:
        raise BadRequest(_bad_mime(param, mime), param)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=[_FORMATS[mime]])  # the header only
            width, height = image.size
            if width * height > config.max_image_pixels:
                raise BadRequest(
                    f"{param}: the image is {width}x{height} pixels; at most "
                    f"{config.max_image_pixels} pixels (gateway.images.max_image_pixels)",
                    param,
                )
            image.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        # PIL's own guard, met while reading the header: far past any sane limit.
        raise BadRequest(
            f"{param}: the image is too large ({e}); at most {config.max_image_pixels} "
            "pixels (gateway.images.max_image_pixels)",
            param,
        ) from e
    except UnidentifiedImageError as e:
        raise BadRequest(
            f"{param}: the data is not a {_FORMATS[mime]} image ({mime})", param
        ) from e
    except (OSError, SyntaxError, ValueError) as e:
        raise BadRequest(f"{param}: the image is truncated or corrupt ({e})", param) from e
    return CheckedImage(data, hashlib.sha256(data).hexdigest(), width, height)


def _bad_mime(param: str, mime: str) -> str:
    return f"{param}: image type {mime!r} is not supported; use image/png, image/jpeg or image/webp"


def _too_many_bytes(param: str, config: ImagesConfig) -> str:
    return (
        f"{param}: the image is over {config.max_image_bytes} bytes "
        "(gateway.images.max_image_bytes)"
    )
