"""The gateway's runtime, wired: controller -> router -> plan executor, plus metrics.

``GatewayService`` is what the HTTP routes call. It takes the gateway, router
and model sections of the config, a tokenizer and the worker specs with a
launcher (Ray actors in ``baton serve``, in-process workers in unit tests).
Everything the router decides with lives in ``router.Router`` (the same object
``baton simulate`` drives): telemetry goes in through ``update``, requests through
the executor's ``place``/``release``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from router.front_door import Router, RouterSettings
from router.planner import RatioPlanner
from router.policy import available_policies
from router.types import SLO, Priority, Role
from services.cluster.controller import Controller, ControllerConfig, Launcher
from services.cluster.rebalance import Rebalancer
from services.config import GatewayConfig, ModelConfig, RouterConfig
from services.engine.messages import ImageInput, SamplingParams
from services.engine.placeholders import read_image_prompt_spec
from services.gateway.deadline import until_deadline
from services.gateway.executor import ExecutorConfig, PlanExecutor
from services.gateway.placement import HoldSettings
from services.gateway.tokens import Tokenizer
from services.metrics import BatonMetrics
from services.workers.client import WorkerClient
from services.workers.messages import TokenDelta, WorkerSnapshot
from services.workers.worker import WorkerSpec

__all__ = ["ControllerFactory", "GatewayService", "GatewaySettings", "make_router"]

log = logging.getLogger(__name__)

_FALLBACK_POLICY = "round_robin"


# (on_snapshot, on_worker_down, on_worker_up) -> a controller found elsewhere
# (cluster.remote.RemoteController)
ControllerFactory = Callable[
    [Callable[[WorkerSnapshot], None], Callable[[str, Role], None], Callable[[str], None]], Any
]


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    gateway: GatewayConfig
    router: RouterConfig
    model: ModelConfig
    kv_backend: str


def make_router(config: RouterConfig) -> Router:
    """The configured router, or one with round_robin (said loudly) if the policy is unknown."""
    settings = RouterSettings.from_config(config)
    if settings.policy not in available_policies():
        log.warning(
            "router policy %r is not available (have: %s); falling back to %r",
            settings.policy,
            ", ".join(available_policies()),
            _FALLBACK_POLICY,
        )
        settings = dataclasses.replace(settings, policy=_FALLBACK_POLICY)
    return Router(settings)


class GatewayService:
    def __init__(
        self,
        settings: GatewaySettings,
        tokenizer: Tokenizer,
        specs: Sequence[WorkerSpec],
        launch: Launcher,
        *,
        metrics: BatonMetrics | None = None,
        controller_config: ControllerConfig | None = None,
        rebalance: bool = True,
        remote_controller: ControllerFactory | None = None,
    ) -> None:
        """``remote_controller``: a control plane that outlives this gateway (``specs`` and
        ``launch`` unused); role flips are then the control plane's, not this gateway's."""
        self.settings = settings
        self.tokenizer = tokenizer
        self.image_spec = read_image_prompt_spec(settings.model.name)  # None: text only
        self.metrics = metrics or BatonMetrics()
        self.router = make_router(settings.router)
        self._max_model_lens: dict[str, int] = {}
        self.controller: Controller | Any = (
            Controller(
                specs,
                launch,
                on_snapshot=self._on_snapshot,
                on_worker_down=self._on_worker_down,
                config=controller_config,
            )
            if remote_controller is None
            else remote_controller(self._on_snapshot, self._on_worker_down, self.router.revive)
        )
        self.policy_name = self.router.settings.policy
        self.executor = PlanExecutor(
            self.router,
            self.controller.client,
            self.metrics,
            ExecutorConfig(
                kv_backend=settings.kv_backend,
                hold=HoldSettings(max_hold_s=settings.router.max_hold_s),
            ),
            on_worker_died=self.controller.report_dead,
            tokenizer=tokenizer,
        )
        self.rebalancer = (
            self._make_rebalancer() if rebalance and remote_controller is None else None
        )
        self._rebalance_task: asyncio.Task[None] | None = None
        self.started_s = time.time()
        self.draining = False
        self._started = False
        self._num_inflight = 0

    @property
    def model_name(self) -> str:
        return self.settings.model.public_name

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        await self.controller.start()
        self._started = True
        if self.rebalancer is not None:
            self._rebalance_task = asyncio.create_task(self.rebalancer.run_forever())

    async def stop(self) -> None:
        self.draining = True
        if self._rebalance_task is not None:
            self._rebalance_task.cancel()
            await asyncio.gather(self._rebalance_task, return_exceptions=True)
        await self.controller.stop()

    def _make_rebalancer(self) -> Rebalancer | None:
        """A P/D ratio planner loop, when the router's policy can report role pressure."""
        router = self.router
        if not callable(getattr(router.policy, "pressure", None)):
            return None
        return Rebalancer(
            self.controller,
            router.view,
            # The policy's, raised by what admission refused
            # in the window up to now (the clock the executor places requests by).
            lambda view, mean: router.role_pressure(view, mean, time.monotonic()),
            RatioPlanner(interval_s=router.settings.rebalance_interval_s),
            self.metrics,
            lambda: router.mean_prompt_tokens,
        )

    def is_ready(self) -> bool:
        return self.unready_reason() is None

    def unready_reason(self) -> str | None:
        """Why requests are refused with 503 now; None when ready."""
        if not self._started:
            return "the server is starting"
        if self.draining:
            return "the server is draining"
        if not self.router.has_workers():
            return "no worker is up to serve (they are being started or replaced)"
        return None

    def max_model_len(self) -> int | None:
        return min(self._max_model_lens.values(), default=None)

    # -- requests ------------------------------------------------------------------------
    def try_admit(self) -> bool:
        """Count one request in flight, or refuse if the gateway is full."""
        if self._num_inflight >= self.settings.gateway.max_inflight_requests:
            return False
        self._num_inflight += 1
        self.metrics.inflight.inc()
        return True

    def finish(self) -> None:
        self._num_inflight -= 1
        self.metrics.inflight.dec()

    def generate(
        self,
        request_id: str,
        prompt_token_ids: tuple[int, ...],
        sampling: SamplingParams,
        arrival_s: float,
        *,
        slo: SLO | None = None,
        priority: Priority = Priority.INTERACTIVE,
        images: tuple[ImageInput, ...] = (),
    ) -> AsyncGenerator[TokenDelta, None]:
        """Run one request; targets ``slo`` leaves out are ``router.default_slo``'s."""
        stream = self.executor.run(
            request_id,
            prompt_token_ids,
            sampling,
            arrival_s,
            slo=self.request_slo(slo or SLO()),
            priority=priority,
            images=images,
        )
        timeout_s = self.settings.gateway.request_timeout_s
        return until_deadline(stream, arrival_s + timeout_s, timeout_s)

    def request_slo(self, asked: SLO) -> SLO:
        """``asked`` with each missing target taken from ``router.default_slo``."""
        default = self.settings.router.default_slo
        return SLO(
            ttft_s=asked.ttft_s if asked.ttft_s is not None else default.ttft_ms / 1e3,
            tpot_s=asked.tpot_s if asked.tpot_s is not None else default.tpot_ms / 1e3,
        )

    def worker_client(self, worker_id: str) -> WorkerClient | None:
        return self.controller.client(worker_id)

    # -- telemetry -------------------------------------------------------------------------
    def _on_snapshot(self, s: WorkerSnapshot) -> None:
        before = self.router.reports().get(s.worker_id)
        self.router.update(s)
        if self.router.is_alive(s.worker_id):
            self._max_model_lens[s.worker_id] = s.max_model_len
        m, wid, role = self.metrics, s.worker_id, s.role.value
        if before is not None and before.role is not s.role:
            self._drop_worker_series(wid, keep=s.role)  # labels follow the role
        m.kv_blocks.labels(wid, role, "used").set(s.num_used_blocks)
        m.kv_blocks.labels(wid, role, "free").set(s.num_free_blocks)
        m.kv_blocks.labels(wid, role, "cached").set(s.num_cached_blocks)
        m.kv_blocks.labels(wid, role, "held").set(s.num_held_blocks)
        m.worker_requests.labels(wid, role, "running").set(len(s.running))
        m.worker_requests.labels(wid, role, "waiting").set(len(s.waiting_prompt_lens))
        m.worker_preemptions.labels(wid).set(s.num_preemptions)
        if s.num_images_encoded or s.num_image_cache_hits:
            m.worker_images.labels(wid, "encoded").set(s.num_images_encoded)
            m.worker_images.labels(wid, "cached").set(s.num_image_cache_hits)
        self._count_workers()

    def _on_worker_down(self, worker_id: str, role: Role) -> None:
        self.router.mark_dead(worker_id)
        self._max_model_lens.pop(worker_id, None)
        self.metrics.workers.labels(role.value, "dead").inc()
        self._count_workers()
        self._drop_worker_series(worker_id)
        with contextlib.suppress(KeyError):
            self.metrics.worker_preemptions.remove(worker_id)

    def _drop_worker_series(self, worker_id: str, keep: Role | None = None) -> None:
        """Remove the worker's role-labelled series (but ``keep``'s): it may have had
        several roles."""
        m = self.metrics
        for r in Role:
            if r is keep:
                continue
            for state in ("used", "free", "cached", "held"):
                with contextlib.suppress(KeyError):
                    m.kv_blocks.remove(worker_id, r.value, state)
            for state in ("running", "waiting"):
                with contextlib.suppress(KeyError):
                    m.worker_requests.remove(worker_id, r.value, state)

    def _count_workers(self) -> None:
        alive: dict[str, int] = {r.value: 0 for r in Role}
        for s in self.router.reports().values():
            alive[s.role.value] += 1
        for role, n in alive.items():
            self.metrics.workers.labels(role, "alive").set(n)
