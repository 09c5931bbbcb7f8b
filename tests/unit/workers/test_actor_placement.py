"""Ray placement options: a worker asks for its role's custom resource only where nodes offer it."""

from __future__ import annotations

from typing import Any

import pytest

from router.types import Role
from services.workers import actor
from services.workers.worker import WorkerSpec


class _FakeActorClass:
    """Records the options Ray would get; stands in for ``ray.remote(Worker)``."""

    def __init__(self) -> None:
        self.options_seen: dict[str, Any] = {}

    def options(self, **options: Any) -> _FakeActorClass:
        self.options_seen = options
        return self

    def remote(self, spec: WorkerSpec) -> object:
        return object()


@pytest.mark.parametrize(
    ("offered", "role", "expected"),
    [
        ({"CPU", "prefill", "decode"}, Role.DECODE, {"decode": 1}),
        ({"CPU", "prefill", "decode"}, Role.PREFILL, {"prefill": 1}),
        ({"CPU", "prefill"}, Role.DECODE, None),  # no decode pods: unconstrained
        ({"CPU"}, Role.MIXED, None),  # a laptop
    ],
)
def test_role_resource_requested_only_when_offered(
    monkeypatch: pytest.MonkeyPatch, offered: set[str], role: Role, expected: dict[str, int] | None
) -> None:
    fake = _FakeActorClass()
    monkeypatch.setattr(actor, "_actor_class", lambda: fake)
    monkeypatch.setattr(actor, "_cluster_resource_names", lambda: offered)
    spec = WorkerSpec(worker_id="w0", role=role, engine_factory=lambda: None)  # type: ignore[arg-type,return-value]
    actor.launch_ray_worker(spec, num_cpus=0.5, num_gpus=0)
    assert fake.options_seen.get("resources") == expected
    assert fake.options_seen["num_cpus"] == 0.5
