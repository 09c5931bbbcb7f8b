"""The router's settings in the router's units (seconds), built once from the config.

``RouterSettings.from_config`` reads a ``services.config.RouterConfig`` (or anything
with its fields), so ``baton serve`` and ``baton simulate`` build the same router
(``router.front_door.Router``) from one config file; ``policy_options`` is every option
a policy may take from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from router.admission import AdmissionSettings
from router.correction import CorrectionSettings
from router.length import LengthClassifier
from router.profile import DEFAULT_PROFILE, Profile, load_profile
from router.types import SLO, Role

__all__ = ["RouterSettings"]

_DEFAULT_SLO = SLO(ttft_s=2.0, tpot_s=0.2)  # RouterConfig.default_slo's defaults
_DEFAULT_ADMISSION = AdmissionSettings()
_DEFAULT_CORRECTION = CorrectionSettings()


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """The router's settings in the router's units (seconds), built once.

    ``from_config`` reads a ``services.config.RouterConfig`` (or anything with its
    fields), so ``baton serve`` and ``baton simulate`` build the same router from one
    config file."""

    policy: str = "slo_goodput"
    default_slo: SLO = _DEFAULT_SLO
    length_split: str = "spatial"
    length_threshold_tokens: int | None = None
    profile: Profile = DEFAULT_PROFILE
    max_hold_s: float = 5.0
    memory_fraction: float = 0.95
    rebalance_interval_s: float = 10.0
    colocate_roles: tuple[Role, ...] = (Role.MIXED, Role.DECODE)  # may run a whole request
    seed: int = 0
    admission: AdmissionSettings = _DEFAULT_ADMISSION
    correction: CorrectionSettings = _DEFAULT_CORRECTION

    @classmethod
    def from_config(cls, config: Any, profile: Profile | None = None) -> RouterSettings:
        slo = config.default_slo
        if profile is None:
            profile = load_profile(config.profile) if config.profile else DEFAULT_PROFILE
        return cls(
            policy=config.policy,
            default_slo=SLO(ttft_s=slo.ttft_ms / 1e3, tpot_s=slo.tpot_ms / 1e3),
            length_split=config.length_split,
            length_threshold_tokens=config.length_threshold_tokens,
            profile=profile,
            max_hold_s=config.max_hold_s,
            memory_fraction=config.memory_fraction,
            rebalance_interval_s=config.rebalance_interval_s,
            **_admission_from_config(getattr(config, "admission", None)),
        )

    def policy_options(self, classifier: LengthClassifier) -> Mapping[str, Any]:
        """Every option a policy may take; ``make_policy_from_settings`` keeps its own."""
        return {
            "profile": self.profile,
            "default_slo": self.default_slo,
            "length_split": self.length_split,
            "length_threshold_tokens": self.length_threshold_tokens,
            "memory_fraction": self.memory_fraction,
            "max_hold_s": self.max_hold_s,
            "colocate_roles": self.colocate_roles,
            "seed": self.seed,
            "classifier": classifier,
            "slo_headroom": self.admission.headroom,
            "batch_slo_headroom": self.admission.batch_headroom,
            "min_retry_after_s": self.admission.min_retry_after_s,
        }


def _admission_from_config(admission: Any) -> dict[str, Any]:
    """``RouterConfig.admission`` (pydantic, bounded there) as the router's settings."""
    if admission is None:
        return {}
    c = admission.correction
    return {
        "admission": AdmissionSettings(
            enabled=admission.enabled,
            headroom=admission.headroom,
            batch_headroom=admission.batch_headroom,
            min_retry_after_s=admission.min_retry_after_s,
            adaptive=admission.adaptive,
        ),
        "correction": CorrectionSettings(
            window=c.window,
            min_samples=c.min_samples,
            min_scale=c.min_scale,
            max_scale=c.max_scale,
            max_age_s=c.max_age_s,
        ),
    }
