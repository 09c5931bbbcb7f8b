"""In-flight reservations: what a plan will take, added to the view before telemetry shows it.

Between a plan and the worker's next snapshot (up to 100 ms), the gateway
keeps the plan as a reservation so that two requests in the same millisecond
do not both take the last free slot. ``reserve`` returns a new view in which
the prefill worker's queue holds the request's effective tokens and the decode
host runs it (holding its prompt, nothing generated). Only the touched workers
are new objects, so the router's per-worker caches recompute just those rows.
The gateway drops a reservation when the worker's snapshot includes the request.
"""

from __future__ import annotations

import dataclasses

from router.length import effective_prefill_tokens
from router.types import ClusterView, Plan, RequestProfile, RunningRequest, WorkerView

__all__ = ["reserve"]


def reserve(view: ClusterView, plan: Plan, profile: RequestProfile) -> ClusterView:
    decode_id = plan.decode_worker or plan.prefill_worker
    tokens = effective_prefill_tokens(profile)
    held = profile.num_prompt_tokens + profile.num_image_tokens
    workers: list[WorkerView] = []
    for w in view.workers:
        if w.worker_id == plan.prefill_worker:
            cls = plan.length_class
            w = dataclasses.replace(
                w,
                queued_tokens={**w.queued_tokens, cls: w.queued_tokens.get(cls, 0) + tokens},
                queued_requests={**w.queued_requests, cls: w.queued_requests.get(cls, 0) + 1},
            )
        if w.worker_id == decode_id:
            blocks = -(-held // w.block_size)
            w = dataclasses.replace(
                w,
                running=(*w.running, RunningRequest(held, 0, profile.max_tokens)),
                num_free_blocks=max(0, w.num_free_blocks - blocks),
            )
        workers.append(w)
    return dataclasses.replace(view, workers=tuple(workers))
