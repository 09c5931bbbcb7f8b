"""Routing policies and their registry.

A policy is any object with ``plan(profile, view, now_s) -> Plan | Reject``.
Policies register by name; ``make_policy(name, **options)`` builds one and
rejects unknown options; ``make_policy_from_settings(name, settings)`` passes
only the settings that policy takes (the gateway hands every policy the same
router settings, and only ``slo_goodput`` uses most of them).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

from router.types import ClusterView, Plan, Reject, RequestProfile

__all__ = [
    "Policy",
    "available_policies",
    "make_policy",
    "make_policy_from_settings",
    "register_policy",
]


@runtime_checkable
class Policy(Protocol):
    name: str

    def plan(self, profile: RequestProfile, view: ClusterView, now_s: float) -> Plan | Reject: ...


_REGISTRY: dict[str, Callable[..., Policy]] = {}


def register_policy(name: str) -> Callable[[Callable[..., Policy]], Callable[..., Policy]]:
    def wrap(factory: Callable[..., Policy]) -> Callable[..., Policy]:
        if name in _REGISTRY:
            raise ValueError(f"policy {name!r} registered twice")
        _REGISTRY[name] = factory
        return factory

    return wrap


def available_policies() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def make_policy(name: str, **options: Any) -> Policy:
    _load_builtin()
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r}; available: {', '.join(sorted(_REGISTRY))}"
        ) from None
    return factory(**options)


def make_policy_from_settings(name: str, settings: Mapping[str, Any]) -> Policy:
    _load_builtin()
    factory = _REGISTRY.get(name)
    if factory is None:
        return make_policy(name)  # raises with the list of names
    accepted = inspect.signature(factory).parameters
    return factory(**{k: v for k, v in settings.items() if k in accepted and k != "name"})


def _load_builtin() -> None:
    # Importing the module registers the built-in policies.
    import router.policies  # noqa: F401
