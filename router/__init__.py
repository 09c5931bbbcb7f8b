"""Baton's router: pure scheduling (no Ray, HTTP, torch or clock reads).

``Router(RouterSettings.from_config(config))`` is the front door the gateway and the
simulator drive: ``update(snapshot)``, ``place(profile, now_s) -> Plan | Hold | Reject``,
``release(request_id)``. Inside it, ``make_policy(name, **options).plan(profile, view,
now_s) -> Plan | Reject``.

Modules, one idea each:

* ``types``: what the router reads and returns (profiles, views, plans, rejects);
* ``front_door``: ``Router`` and its frozen ``RouterSettings``;
* ``policy`` / ``policies``: the registry and ``round_robin``, ``least_loaded``,
  ``prefix_aware``, ``slo_goodput`` (the default);
* ``profile``: a worker's measured speeds, the seed of its cost model, and their JSON;
* ``cost_model``: prefill/decode/transfer curves refitted online from step telemetry;
* ``estimator``: the past-future KV peak estimator and the engine's admission rule;
* ``length``: effective prefill length, short/long classes, per-class queue waits;
* ``worker_table`` / ``running_sets`` / ``prefix_index``: per-snapshot caches behind
  ``slo_goodput``;
* ``planner`` / ``cli_plan``: P/D pool sizing and role flips; ``baton plan``.
"""

from router.front_door import Hold, Router, RouterSettings
from router.policy import (
    Policy,
    available_policies,
    make_policy,
    make_policy_from_settings,
    register_policy,
)
from router.types import (
    SLO,
    ClusterView,
    LengthClass,
    Plan,
    Priority,
    Reject,
    RequestProfile,
    Role,
    RunningRequest,
    StepSample,
    WorkerView,
)

__all__ = [
    "SLO",
    "ClusterView",
    "Hold",
    "LengthClass",
    "Plan",
    "Policy",
    "Priority",
    "Reject",
    "RequestProfile",
    "Role",
    "Router",
    "RouterSettings",
    "RunningRequest",
    "StepSample",
    "WorkerView",
    "available_policies",
    "make_policy",
    "make_policy_from_settings",
    "register_policy",
]
