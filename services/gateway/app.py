"""The OpenAI-compatible HTTP app (FastAPI on uvicorn).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``
(and ``GET /v1/models/{model}``, the served one or 404),
``GET /health`` (200 ready, 503 starting, draining or no worker up), ``GET /ready`` (the same status,
with every worker slot: ready, starting, or down and why), ``GET /metrics``
(Prometheus), ``GET /openapi.json`` (and its pages ``/docs`` and ``/redoc``). Every
error is OpenAI's nested shape; FastAPI's 422 becomes 400 naming the field; bodies over
``max_body_bytes`` get 413; an unknown route or method is answered with every route
served (``served_routes``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.access import AccessGate, KeyFile
from services.gateway.bounds import check_bounds
from services.gateway.errors import (
    APIError,
    ModelNotFound,
    NotReady,
    PayloadTooLarge,
)
from services.gateway.fields import check_fields
from services.gateway.images import chat_prompt
from services.gateway.invalid import validation_error
from services.gateway.prepare import prepare_chat, prepare_completion
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from services.gateway.respond import respond
from services.gateway.service import GatewayService
from services.gateway.tokens import chat_prompt_ids, text_prompt_ids

__all__ = ["create_app", "served_routes"]

T = TypeVar("T")


def create_app(svc: GatewayService, *, manage_lifecycle: bool = True) -> FastAPI:
    """The app over ``svc``; with ``manage_lifecycle`` its lifespan starts and stops the cluster."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if manage_lifecycle:
            await svc.start()
        try:
            yield
        finally:
            if manage_lifecycle:
                await svc.stop()

    app = FastAPI(title="Baton", version="0.1.0", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_body_bytes=svc.settings.gateway.max_body_bytes)
    _add_error_handlers(app)
    gate = AccessGate(KeyFile(svc.settings.gateway), svc.metrics)
    auth = gate.authenticate

    def ready() -> None:
        reason = svc.unready_reason()
        if reason is not None:
            raise NotReady(reason, 5.0)

    def check_model(name: str) -> None:
        if name != svc.model_name:
            raise ModelNotFound(f"The model `{name}` does not exist.", "model", "model_not_found")

    @app.get("/health", include_in_schema=False)
    async def health() -> Response:
        return Response(status_code=200 if svc.is_ready() else 503)

    @app.get("/ready", include_in_schema=False)
    async def readiness() -> JSONResponse:
        # /health is the liveness check (and stays cheap); this says which workers are up.
        workers = [
            {
                "worker_id": w.worker_id,
                "role": w.role.value,
                "state": w.state,
                "reason": w.reason,
                "since": w.since_s,
            }
            for w in svc.controller.readiness()
        ]
        up = svc.is_ready()
        return JSONResponse({"ready": up, "workers": workers}, status_code=200 if up else 503)

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(generate_latest(svc.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict[str, Any]:
        return {
            "id": svc.model_name,
            "object": "model",
            "created": int(svc.started_s),
            "owned_by": "baton",
            "root": svc.settings.model.name,
            "parent": None,
            "max_model_len": svc.max_model_len(),
        }

    @app.get("/v1/models", dependencies=[Depends(auth)])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    # ``:path``: a served name may have slashes (``meta-llama/Llama-3.1-8B``).
    @app.get("/v1/models/{model:path}", dependencies=[Depends(auth)])
    async def model(model: str) -> dict[str, Any]:
        check_model(model)
        return model_card()

    @app.post("/v1/chat/completions", dependencies=[Depends(auth)])
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        check_model(body.model)
        check_fields(body)
        ready()
        check_bounds(body, svc.settings.gateway, svc.tokenizer.vocab_size)
        if body.image_urls():
            prompt, images = await chat_prompt(
                body, svc.tokenizer, svc.image_spec, svc.settings.gateway.images
            )
        else:
            prompt = await _off_loop_if_large(
                request, chat_prompt_ids, svc.tokenizer, body.chat_messages(), body.template_tools()
            )
            images = ()
        gen = prepare_chat(svc, body, prompt, images)
        return await gate.run(request, gen, lambda on_finish: respond(svc, gen, request, on_finish))

    @app.post("/v1/completions", dependencies=[Depends(auth)])
    async def completions(body: CompletionRequest, request: Request) -> Any:
        check_model(body.model)
        check_fields(body)
        ready()
        # Before tokenizing: a huge fan-out is refused at once.
        check_bounds(body, svc.settings.gateway, svc.tokenizer.vocab_size)
        prompts = await _off_loop_if_large(request, text_prompt_ids, svc.tokenizer, body.prompt)
        gen = prepare_completion(svc, body, prompts)
        return await gate.run(request, gen, lambda on_finish: respond(svc, gen, request, on_finish))

    return app


_INLINE_TOKENIZE_BYTES = 64 * 2**10


async def _off_loop_if_large(request: Request, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, in a thread when the body is large: tokenizing (and rendering a chat
    template over) megabytes takes long enough to stall every other request and /health."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) <= _INLINE_TOKENIZE_BYTES:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status_code, headers=e.headers())


def served_routes(app: FastAPI) -> list[tuple[str, str]]:
    """(method, path) of every route ``app`` answers, the OpenAPI schema's first, then
    the rest in the order they were added (HEAD, which answers with GET, and the API
    docs' OAuth2 redirect helper left out): what a 404 or 405 names."""
    ordered = sorted(app.routes, key=lambda r: not getattr(r, "include_in_schema", False))
    served = []
    for route in ordered:
        path = getattr(route, "path", None)
        if path is None or path == app.swagger_ui_oauth2_redirect_url:
            continue
        for method in sorted(getattr(route, "methods", None) or ()):
            if method != "HEAD":  # path_format: ``{model}``, not ``{model:path}``
                served.append((method, getattr(route, "path_format", path)))
    return served


def _served_text(app: FastAPI) -> str:
    """The sentence a 404 or 405 ends with: "Baton serves GET /v1/models, ... and GET
    /metrics" (made once per app)."""
    text = getattr(app.state, "served_text", None)
    if text is None:
        names = [f"{method} {path}" for method, path in served_routes(app)]
        text = app.state.served_text = "Baton serves " + (
            f"{', '.join(names[:-1])} and {names[-1]}" if len(names) > 1 else "".join(names)
        )
    return str(text)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return _error_response(e)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        content_type = request.headers.get("content-type", "")
        return _error_response(validation_error(e.errors(), content_type))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = str(e.detail)
        path = request.url.path
        if e.status_code == 404 and message == "Not Found":  # no such route
            message = f"no route {path}; {_served_text(app)}"
        elif e.status_code == 405:
            allowed = [m for m, p in served_routes(app) if p == path]
            message = (
                f"{request.method} is not allowed on {path}, only {' and '.join(allowed)}; "
                f"{_served_text(app)}"
            )
        error = APIError(message)
        error.status_code = e.status_code
        error.error_type = "NotFoundError" if e.status_code == 404 else "InvalidRequestError"
        response = _error_response(error)
        response.headers.update(e.headers or {})  # a 405's Allow
        return response


class BodyLimit:
    """Answer 413 for request bodies over the limit, declared or streamed."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._reject(send)
            return
        received = 0
        too_large = False

        async def limited_receive() -> Message:
            nonlocal received, too_large
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    too_large = True
                    raise _TooLarge
            return message

        async def guarded_send(message: Message) -> None:
            # Whatever the app answers to a body it could not finish reading is replaced.
            if not too_large:
                await send(message)

        with contextlib.suppress(_TooLarge):  # answered just below
            await self.app(scope, limited_receive, guarded_send)
        if too_large:
            await self._reject(send)

    async def _reject(self, send: Send) -> None:
        error = PayloadTooLarge(f"request body is larger than {self.max_body_bytes} bytes")
        body = json.dumps(error.body()).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass
