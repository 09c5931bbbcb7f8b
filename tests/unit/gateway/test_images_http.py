"""Images through the chat API: an in-process gateway over real tiny-vl engines (no Ray).

Good images give the text the engine gives for the same image, colocated and
disaggregated; bad ones (truncated, a 30000x30000 header, a wrong MIME type, too many,
an http URL while fetching is off) each get a 400 naming the problem, and the server
keeps serving.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import http.server
import struct
import threading
import zlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from services.cluster.controller import ControllerConfig
from services.cluster.factories import ConnectorFactory, EngineFactory
from services.cluster.launchers import launch_in_process
from services.cluster.specs import worker_specs
from services.config import ClusterConfig
from services.engine.loader import load_tokenizer
from services.engine.messages import EngineRequest, ImageInput
from services.engine.placeholders import TINY_VL_IMAGE_PROMPT
from services.gateway.app import create_app
from services.gateway.service import GatewayService, GatewaySettings
from tests.unit.engine.engine_helpers import greedy, make_engine, serve
from tests.unit.engine.llava_twin import png_bytes, random_image

MODEL = "tiny-vl"
NUM_NEW = 12


def _config(mode: str, **overrides: Any) -> ClusterConfig:
    base = {
        "model.name": MODEL,
        "workers.mode": mode,
        "workers.prefill": 1,
        "workers.decode": 1,
        "workers.num_cpus": 0,
        "kvtransfer.backend": "local",
        "router.policy": "round_robin",
        "router.max_hold_s": 0.0,
        "engine.device": "cpu",
        "engine.block_size": 4,
        "engine.num_threads": 1,
        "engine.kv_cache_bytes": 4 * 2**20,
    }
    return ClusterConfig().with_overrides({**base, **overrides})


Gateway = Callable[..., Any]


@pytest.fixture
async def gateway() -> AsyncIterator[Gateway]:
    started: list[tuple[GatewayService, httpx.AsyncClient]] = []

    async def make(mode: str = "colocated", **overrides: Any) -> httpx.AsyncClient:
        config = _config(mode, **overrides)
        specs = worker_specs(
            config,
            EngineFactory("embedded", config.model, config.engine),
            ConnectorFactory(config.kvtransfer),
        )
        settings = GatewaySettings(
            config.gateway, config.router, config.model, config.kvtransfer.backend
        )
        svc = GatewayService(
            settings,
            load_tokenizer(config.model.name),
            specs,
            launch_in_process,
            controller_config=ControllerConfig(replace_dead=False),
        )
        await svc.start()
        app = create_app(svc, manage_lifecycle=False)
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        started.append((svc, client))
        return client

    yield make
    for svc, client in started:
        await client.aclose()
        await svc.stop()


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _body(*urls: str, text: str = "what is this?") -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],
        "max_completion_tokens": NUM_NEW,
        "temperature": 0,
        "ignore_eos": True,
    }


def _expected_text(images: list[bytes], text: str = "what is this?") -> str:
    """The engine's own greedy text for the same chat (the oracle against transformers)."""
    engine = make_engine(MODEL)
    parts = [{"type": "image_url", "image_url": {"url": ""}}] * len(images)
    chat = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]
    )
    spec = TINY_VL_IMAGE_PROMPT
    prompt: list[int] = []
    offsets = []
    for t in engine.tokenizer.encode(chat, add_special_tokens=False):
        if t == spec.image_token_id:
            offsets.append(len(prompt))
            prompt.extend([t] * spec.num_image_tokens)
        else:
            prompt.append(t)
    inputs = tuple(
        ImageInput(hashlib.sha256(d).hexdigest(), o, spec.num_image_tokens, data=d)
        for d, o in zip(images, offsets)
    )
    out = serve(engine, [EngineRequest("x", tuple(prompt), greedy(NUM_NEW), images=inputs)])
    return engine.tokenizer.decode(out["x"])


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
async def test_image_chat_gives_the_engines_text(gateway: Gateway, mode: str) -> None:
    client = await gateway(mode)
    images = [png_bytes(random_image(1, 48, 40)), png_bytes(random_image(2, 20, 70))]
    reply = await client.post("/v1/chat/completions", json=_body(*map(_data_url, images)))
    assert reply.status_code == 200, reply.text
    text = reply.json()["choices"][0]["message"]["content"]
    assert text == _expected_text(images)
    other = await client.post(
        "/v1/chat/completions", json=_body(_data_url(png_bytes(random_image(3, 32, 32))))
    )
    assert other.json()["choices"][0]["message"]["content"] != text  # images steer the text
    # A text-only request to the multimodal model keeps working.
    plain = await client.post(
        "/v1/chat/completions",
        json={**_body(), "messages": [{"role": "user", "content": "hello"}]},
    )
    assert plain.status_code == 200, plain.text


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` (a decompression bomb's calling card)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 1024)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


GOOD = png_bytes(random_image(4, 40, 40))


@pytest.mark.parametrize(
    ("urls", "message", "param"),
    [
        ([_data_url(GOOD[: len(GOOD) // 2])], "truncated or corrupt", "messages[0].content[0]"),
        ([_data_url(_png_header(30000, 30000))], "too large", "messages[0].content[0]"),
        ([_data_url(_png_header(100, 100))], "100x100 pixels", "messages[0].content[0]"),
        ([_data_url(b"GIF89a....", "image/gif")], "image/gif", "messages[0].content[0]"),
        ([_data_url(GOOD, "image/jpeg")], "not a JPEG", "messages[0].content[0]"),
        ([_data_url(GOOD)] * 3, "at most 2", "messages"),
        (["http://example.com/cat.png"], "fetching remote images is off", "messages[0].content[0]"),
        (["data:image/png;base64,@@@@"], "base64", "messages[0].content[0]"),
    ],
    ids=[
        "truncated",
        "bomb_header",
        "over_limit_header",
        "gif",
        "mime_mismatch",
        "too_many",
        "http",
        "bad_base64",
    ],
)
async def test_bad_images_are_400s_naming_the_problem(
    gateway: Gateway, urls: list[str], message: str, param: str
) -> None:
    limits = {"gateway.images.max_images_per_request": 2, "gateway.images.max_image_pixels": 2000}
    client = await gateway(**limits)
    reply = await client.post("/v1/chat/completions", json=_body(*urls))
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert message in error["message"]
    assert error["param"] == param
    ok = await client.post("/v1/chat/completions", json=_body(_data_url(GOOD)))
    assert ok.status_code == 200, ok.text  # and it keeps serving


async def test_a_text_model_refuses_images(gateway: Gateway) -> None:
    client = await gateway(**{"model.name": "tiny"})
    reply = await client.post(
        "/v1/chat/completions", json={**_body(_data_url(GOOD)), "model": "tiny"}
    )
    assert reply.status_code == 400
    assert "does not accept images" in reply.json()["error"]["message"]


class _ImageServer(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = GOOD if self.path == "/good.png" else GOOD * 50
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


async def test_remote_images_follow_the_allow_list_and_the_byte_cap(gateway: Gateway) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ImageServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        limits = {
            "gateway.images.fetch_hosts": ["127.0.0.1"],
            "gateway.images.max_image_bytes": len(GOOD) * 10,
        }
        client = await gateway(**limits)
        ok = await client.post("/v1/chat/completions", json=_body(f"{base}/good.png"))
        assert ok.status_code == 200, ok.text
        inline = await client.post("/v1/chat/completions", json=_body(_data_url(GOOD)))
        assert ok.json()["choices"][0]["message"] == inline.json()["choices"][0]["message"]
        big = await client.post("/v1/chat/completions", json=_body(f"{base}/big.png"))
        assert big.status_code == 400
        assert "max_image_bytes" in big.json()["error"]["message"]
        port = server.server_address[1]
        other = await client.post(
            "/v1/chat/completions", json=_body(f"http://localhost:{port}/good.png")
        )
        assert other.status_code == 400
        assert "not allowed" in other.json()["error"]["message"]
    finally:
        server.shutdown()


async def test_the_same_image_twice_is_encoded_once_and_metrics_say_so(gateway: Gateway) -> None:
    client = await gateway("colocated", **{"workers.prefill": 1, "workers.decode": 0})
    body = _body(_data_url(GOOD))
    first = await client.post("/v1/chat/completions", json=body)
    second = await client.post("/v1/chat/completions", json=body)
    text = first.json()["choices"][0]["message"]["content"]
    assert second.json()["choices"][0]["message"]["content"] == text == _expected_text([GOOD])
    wanted = ('baton_worker_images{source="encoded",', 'baton_worker_images{source="cached",')
    wanted = tuple(f'{w}worker="mixed-0"}} 1.0' for w in wanted)
    metrics = ""
    for _ in range(200):  # telemetry arrives within ~100 ms of the finish
        metrics = (await client.get("/metrics")).text
        if all(w in metrics for w in wanted):
            break
        await asyncio.sleep(0.01)
    assert all(w in metrics for w in wanted), [m for m in metrics.splitlines() if "images" in m]
