"""A real uvicorn server for a GatewayService, on 127.0.0.1 and a free port, in a thread.

The service lives on the server's event loop; ``call(coro)`` runs a coroutine
there (to reach worker clients, the state, the executor) from a sync test.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import uvicorn

from services.cluster.serve import bind_listener
from services.gateway.app import create_app
from services.gateway.connections import uvicorn_config
from services.gateway.service import GatewayService

T = TypeVar("T")


class ServedGateway:
    def __init__(self, svc: GatewayService, startup_timeout_s: float = 180.0) -> None:
        self.svc = svc
        self._timeout_s = startup_timeout_s
        self._sock = bind_listener("127.0.0.1", 0)  # as ``baton serve`` binds
        self.port = self._sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn_config(
            create_app(svc), svc.settings.gateway, log_level="warning", timeout_graceful_shutdown=5
        )
        self._server = uvicorn.Server(config)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="uvicorn", daemon=True)
        self._error: BaseException | None = None

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._server.serve(sockets=[self._sock]))
        except BaseException as e:
            self._error = e

    def __enter__(self) -> ServedGateway:
        self._thread.start()
        deadline = time.monotonic() + self._timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start: {self._error!r}")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=60)
        self._sock.close()

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)
