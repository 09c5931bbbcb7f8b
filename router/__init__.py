"""Baton's router: pure scheduling (no Ray, HTTP, torch or clock reads).

``make_policy(name, **options).plan(profile, view, now_s) -> Plan | Reject``;
the cost model, the past-future estimator, length classes and the P/D planner
live in their own modules.
"""

from router.policy import Policy, available_policies, make_policy, register_policy
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
    "LengthClass",
    "Plan",
    "Policy",
    "Priority",
    "Reject",
    "RequestProfile",
    "Role",
    "RunningRequest",
    "StepSample",
    "WorkerView",
    "available_policies",
    "make_policy",
    "register_policy",
]
