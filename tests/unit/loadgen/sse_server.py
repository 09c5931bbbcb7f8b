"""A scripted OpenAI-style SSE server on a real socket (127.0.0.1, ephemeral port), for tests.

``/v1/completions`` and ``/v1/chat/completions`` wait ``FIRST_DELAY_S``, then
stream ``max_tokens`` one-character chunks ``GAP_S`` apart, a usage chunk with
``choices: []`` and ``[DONE]``. A prompt starting with ``FAIL`` gets a 400; one
starting with ``BREAK`` gets an error event after the first token; one
starting with ``HOLD`` gets its first token with empty text (a server holding
back a partial UTF-8 character) and its second ``HOLD_GAP_S`` later. ``serve(api_key=K)``: every route wants
``Authorization: Bearer K`` (a 401 otherwise).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

FIRST_DELAY_S = 0.05
GAP_S = 0.02
HOLD_GAP_S = 0.5
MODEL = "scripted-model"


def _chunk(kind: str, text: str) -> dict[str, object]:
    if kind == "chat":
        choice: dict[str, object] = {"index": 0, "delta": {"content": text}, "finish_reason": None}
        return {"object": "chat.completion.chunk", "choices": [choice], "usage": None}
    return {"object": "text_completion", "choices": [{"index": 0, "text": text}], "usage": None}


@dataclass
class Timing:
    """Delays of the scripted stream; the per-token and per-stream terms model an engine."""

    first_s: float = FIRST_DELAY_S
    first_per_prompt_char_s: float = 0.0
    gap_s: float = GAP_S
    gap_per_stream_s: float = 0.0
    active_streams: int = 0


async def _stream(kind: str, prompt: str, max_tokens: int, timing: Timing) -> AsyncIterator[bytes]:
    timing.active_streams += 1
    try:
        async for chunk in _chunks(kind, prompt, max_tokens, timing):
            yield chunk
    finally:
        timing.active_streams -= 1


async def _chunks(kind: str, prompt: str, max_tokens: int, timing: Timing) -> AsyncIterator[bytes]:
    if kind == "chat":  # role-only first chunk carries no text and must not count as TTFT
        first = {
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
        }
        yield f"data: {json.dumps(first)}\n\n".encode()
    await asyncio.sleep(timing.first_s + timing.first_per_prompt_char_s * len(prompt))
    for i in range(max_tokens):
        if i == 1 and prompt.startswith("HOLD"):
            await asyncio.sleep(HOLD_GAP_S)
        elif i:
            await asyncio.sleep(timing.gap_s + timing.gap_per_stream_s * timing.active_streams)
        text = "" if i == 0 and prompt.startswith("HOLD") else "x"
        yield f"data: {json.dumps(_chunk(kind, text))}\n\n".encode()
        if prompt.startswith("BREAK"):
            yield b'data: {"error": {"message": "worker died", "type": "InternalServerError", "code": 500}}\n\n'
            yield b"data: [DONE]\n\n"
            return
    usage = {
        "prompt_tokens": len(prompt),
        "completion_tokens": max_tokens,
        "total_tokens": len(prompt) + max_tokens,
    }
    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
    yield b"data: [DONE]\n\n"


def _unauthorized(request: Request) -> Response | None:
    key = request.app.state.api_key
    if key is None or request.headers.get("authorization") == f"Bearer {key}":
        return None
    err = {"error": {"message": "Incorrect API key provided.", "type": "AuthenticationError"}}
    return JSONResponse(err, status_code=401)


async def _generate(request: Request) -> Response:
    refused = _unauthorized(request)
    if refused is not None:
        return refused
    timing: Timing = request.app.state.timing
    body = await request.json()
    kind = "chat" if request.url.path.endswith("chat/completions") else "completions"
    prompt = body["messages"][0]["content"] if kind == "chat" else body["prompt"]
    if prompt.startswith("FAIL"):
        err = {
            "error": {
                "message": "bad prompt",
                "type": "BadRequestError",
                "param": "prompt",
                "code": 400,
            }
        }
        return JSONResponse(err, status_code=400)
    stream = _stream(kind, prompt, int(body["max_tokens"]), timing)
    return StreamingResponse(stream, media_type="text/event-stream")


async def _models(request: Request) -> Response:
    refused = _unauthorized(request)
    if refused is not None:
        return refused
    return JSONResponse(
        {
            "object": "list",
            "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "test"}],
        }
    )


def make_app(timing: Timing | None = None, api_key: str | None = None) -> Starlette:
    app = Starlette(
        routes=[
            Route("/v1/completions", _generate, methods=["POST"]),
            Route("/v1/chat/completions", _generate, methods=["POST"]),
            Route("/v1/models", _models),
        ]
    )
    app.state.timing = timing or Timing()
    app.state.api_key = api_key
    return app


@contextmanager
def serve(timing: Timing | None = None, api_key: str | None = None) -> Iterator[str]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(make_app(timing, api_key), log_level="warning", lifespan="off")
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
