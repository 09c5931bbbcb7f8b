"""How much goodput ANY placement policy could reach: a fluid bound from the profile.

Every request costs prefill seconds on some GPU and a share of a decode GPU's
seconds. With the workload's sampled lengths and the profile:

* prefill: ``b·n + c·n² + a·n/budget`` per request (the step's fixed cost ``a``
  shared by the ``budget`` tokens of a full prefill step);
* decode: a decode GPU runs the largest batch ``B`` whose step
  ``a + b·B + c·B·L`` stays within the TPOT target (``L``: the mean context of
  a running sequence, weighted by how long each sequence decodes), capped by
  ``max_num_seqs`` and by KV memory; it yields ``B / step`` tokens/s, and a
  request needs ``output_len - 1`` of them (the first token comes from prefill).

For a split of ``P`` prefill and ``D`` decode GPUs, the rate served with every
request completed is at most ``min(P / prefill_s, D / decode_s)``; with no
split fixed, ``G / (prefill_s + decode_s)``. Goodput at 90% attainment may leave
10% unserved, so it is at most that divided by 0.9 when the unserved are
a random tenth (``random_shed``), and more when they are the costliest tenth
(``costliest_shed``: drop the most expensive requests, here the long
documents — a fairness choice, not a placement one).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loadgen.sim.profile import Profile
from loadgen.workload import RequestSpec

__all__ = ["FluidBound", "fluid_bound"]


@dataclass(frozen=True, slots=True)
class FluidBound:
    served_all_rps: float  # every request completed
    random_shed_rps: float  # goodput bound at the attainment target, a random share unserved
    costliest_shed_rps: float  # the same, the costliest share unserved
    decode_batch: int  # B of the decode GPU at the TPOT target


def _decode_rate_tokens_per_s(
    profile: Profile, tpot_s: float, mean_context: float
) -> tuple[float, int]:
    d = profile.decode
    capacity_tokens = profile.num_kv_blocks * profile.block_size
    best = (0.0, 0)
    for batch in range(1, profile.max_num_seqs + 1):
        step_s = d.a + d.b * batch + d.c * batch * mean_context
        if step_s > tpot_s or batch * mean_context > capacity_tokens:
            break
        best = (batch / step_s, batch)
    return best


def fluid_bound(
    profile: Profile,
    specs: list[RequestSpec],
    tpot_s: float,
    num_prefill: int,
    num_decode: int,
    *,
    gpus: int | None = None,
    prefill_budget_tokens: int = 8192,
    attainment: float = 0.9,
) -> FluidBound:
    """The bound for a ``num_prefill:num_decode`` split, or for ``gpus`` with no split fixed."""
    n = np.array([s.input_len for s in specs], dtype=float)
    out = np.array([max(1, s.output_len) for s in specs], dtype=float)
    p = profile.prefill
    prefill_s = p.b * n + p.c * n * n + p.a * n / prefill_budget_tokens
    # A sequence decodes for out - 1 steps; its mean context over them is n + out/2.
    steps = out - 1
    mean_context = float((steps * (n + out / 2)).sum() / max(1.0, steps.sum()))
    tokens_per_s, batch = _decode_rate_tokens_per_s(profile, tpot_s, mean_context)
    decode_s = steps / tokens_per_s if tokens_per_s else np.full_like(steps, np.inf)

    def rate(kept: np.ndarray) -> float:
        pf, dc = float(prefill_s[kept].mean()), float(decode_s[kept].mean())
        if gpus is not None:
            return gpus / (pf + dc)
        return min(num_prefill / pf, num_decode / dc)

    everyone = np.ones(len(specs), dtype=bool)
    served_all = rate(everyone)
    costliest_first = np.argsort(-(prefill_s + decode_s))
    kept = everyone.copy()
    kept[costliest_first[: round((1 - attainment) * len(specs))]] = False
    return FluidBound(
        served_all_rps=served_all,
        random_shed_rps=served_all / attainment,
        costliest_shed_rps=rate(kept) / attainment,
        decode_batch=batch,
    )
