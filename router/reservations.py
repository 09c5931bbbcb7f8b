"""What the router has placed that the workers' telemetry does not count yet.

A plan is reserved on its workers from ``Router.place`` until each worker's telemetry
counts it, or the request ends (``release(id)``). A worker's first event for the request
(``Router.release(id, worker)``) ends what it queued there at once: a prefill or encode
worker's part goes, and so do the decode worker's inbound KV and a colocated host's
queued prompt. What the request runs on (its running row and blocks) stays shown until
that worker's next report, which counts it (``Reservations.counted``): the report
before the first event did not, so dropping it then would hide the request for up to a
report interval. A prompt queued on a worker whose report names it waiting
(``WorkerReport.waiting_request_ids``) is counted by the reports from then on, not by
its reservation (``Reservations.waiting``).

``Reservations`` keeps them by request and by worker, oldest first; ``worker_view``
shows a worker as the policy must see it: its last report plus what is reserved there
(prompts queued to prefill, running rows and blocks to decode, KV inbound over its link).

A request whose images are encoded on encode workers reaches its prefill worker only
when the last of them answers (the gateway and the simulator send it then): until
then it is not in that worker's queue (``Reservation.encoding``), and whatever is
placed there meanwhile goes ahead of it. Counted there from placement, it made every
prompt placed behind it during its encode look later by its prefill (in the simulator,
5 encode + 8 prefill + 3 decode at 90 req/s, image bursts: text requests' TTFT
over-predicted by up to 50 ms at p10), and made the worker's oldest waiting prompt
look as old as the encode (``Router.pending_age_s``).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from router.image_parts import part_tokens
from router.length import effective_prefill_tokens
from router.profile import TransferCoeffs
from router.types import (
    LengthClass,
    Plan,
    RequestProfile,
    RunningRequest,
    WorkerReport,
    WorkerView,
)

__all__ = ["Reservation", "Reservations", "worker_view"]


@dataclass(slots=True)
class Reservation:
    plan: Plan
    workers: set[str]  # the plan's workers whose telemetry does not count it yet
    prefill_tokens: int
    length_class: LengthClass
    held_tokens: int
    max_tokens: int
    placed_s: float | None = None  # when ``place`` made it (None: reserved from outside)
    image_tokens: int = 0  # queued on the plan's encode worker until its first event
    # Split over several encode workers: each one's share of ``image_tokens``.
    encode_tokens: dict[str, int] | None = None
    # Its row in the decode worker's running set, one object for its lifetime: the
    # policy keeps a request's memory-estimate draws while the same object runs there.
    running: RunningRequest | None = None
    # Set at the first event of the worker it runs on: that worker's report seq then.
    started_seq: int | None = None
    # The prefill worker's last report seq when it was placed: placed since that
    # report, its prompt waits for the engine step after the one running there.
    placed_seq: int | None = None
    # When its first token is due (router clock; inf: no TTFT target): what a prompt
    # placed after it into the same engine step must not push it past.
    deadline_s: float = math.inf
    # Its prefill worker's report shows its prompt waiting there (``Reservations.waiting``):
    # the view counts the prompt from the report, not from here, until its first event.
    queue_reported: bool = False

    @property
    def encoding(self) -> bool:
        """Its images are still on encode workers (one has not answered): it reaches
        its prefill worker's queue only then."""
        plan = self.plan
        if plan.encode_worker is None and not plan.encode_parts:
            return False  # most plans: asked for every reservation of every view built
        return any(w in self.workers for w in plan.encode_workers)


class Reservations:
    """Reservations by request id, and each worker's request ids, oldest first."""

    def __init__(self) -> None:
        self._by_id: dict[str, Reservation] = {}
        # worker id -> reserving request ids, oldest first (a dict keeps insertion order)
        self._by_worker: dict[str, dict[str, None]] = {}
        # worker id -> request ids started there, not yet counted by a report
        self._started: dict[str, dict[str, None]] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def add(
        self,
        profile: RequestProfile,
        plan: Plan,
        classify: Callable[[int], LengthClass],
        placed_s: float | None,
        placed_seq: int | None = None,
        deadline_s: float = math.inf,
    ) -> tuple[str, ...]:
        """Reserve ``plan`` for ``profile`` (in place of any earlier reservation of the
        request); returns the workers whose view it changes. ``placed_seq``: the prefill
        worker's last report seq now; ``deadline_s``: when its first token is due."""
        rid = profile.request_id
        dropped = self.drop(rid)
        tokens = effective_prefill_tokens(profile)
        touched = plan.workers
        self._by_id[rid] = Reservation(
            plan,
            set(touched),
            tokens,
            classify(tokens),
            profile.num_prompt_tokens + profile.num_image_tokens,
            profile.max_tokens,
            placed_s,
            profile.num_image_tokens,
            _encode_tokens(plan, profile),
            placed_seq=placed_seq,
            deadline_s=deadline_s,
        )
        for wid in touched:
            self._by_worker.setdefault(wid, {})[rid] = None
        return (*dropped, *touched)

    def drop(self, request_id: str, worker_id: str | None = None) -> Sequence[str]:
        """Drop ``worker_id``'s part of a reservation (None: all of it); returns the
        workers whose view that changes."""
        r = self._by_id.get(request_id)
        if r is None:
            return ()
        dropped = tuple(r.workers) if worker_id is None else tuple(r.workers & {worker_id})
        was_encoding = r.encoding
        for wid in dropped:
            r.workers.discard(wid)
            ids = self._by_worker.get(wid)
            if ids is not None:
                ids.pop(request_id, None)
            started = self._started.get(wid)
            if started is not None:
                started.pop(request_id, None)
        if not r.workers:
            del self._by_id[request_id]
        elif was_encoding and not r.encoding and r.plan.prefill_worker in r.workers:
            return (*dropped, r.plan.prefill_worker)  # it joins that worker's queue now
        return dropped

    def start(self, request_id: str, worker_id: str, seq: int | None) -> Sequence[str]:
        """``worker_id``'s first event for the request, while its last report (``seq``;
        None: none yet) does not count it: the part it queued there goes; where the
        request runs on it, its running row and blocks stay until ``counted``. Returns
        the workers whose view that changes."""
        r = self._by_id.get(request_id)
        if r is None or worker_id not in r.workers:
            return ()
        plan = r.plan
        if seq is None or (plan.decode_worker or plan.prefill_worker) != worker_id:
            return self.drop(request_id, worker_id)
        if r.started_seq is not None:
            return ()
        r.started_seq = seq
        self._started.setdefault(worker_id, {})[request_id] = None
        # Its inbound KV has landed, or (colocated) its prompt has left the queue.
        return (worker_id,)

    def waiting(self, worker_id: str, request_ids: Sequence[str]) -> None:
        """``worker_id`` reported these prompts waiting there: the ones reserved to
        prefill there are counted by its reports from now on, not by their reservation
        (whose running row and blocks, where it also decodes there, stay until a report
        shows it running: ``start``, ``counted``). Without this a prompt counted twice in
        its worker's queue from the worker's admission of it to its first token."""
        ids = self._by_worker.get(worker_id)
        if not ids:
            return
        for request_id in request_ids:
            if request_id in ids:
                r = self._by_id[request_id]
                if r.plan.prefill_worker == worker_id:
                    r.queue_reported = True

    def counted(self, worker_id: str, seq: int) -> None:
        """``worker_id`` reported at ``seq``: the requests started there before that
        report count in it, so their reservations there go (the report's new view shows
        them)."""
        started = self._started.get(worker_id)
        if not started:
            return
        for request_id in list(started):
            r = self._by_id[request_id]
            if r.started_seq is not None and r.started_seq < seq:
                self.drop(request_id, worker_id)

    def drop_worker(self, worker_id: str) -> set[str]:
        """A dead worker: every reservation that touches it goes whole; returns the
        workers whose view that changes."""
        changed: set[str] = set()
        for request_id in self._by_worker.pop(worker_id, {}):
            changed.update(self.drop(request_id))
        self._started.pop(worker_id, None)
        return changed

    def on(self, worker_id: str) -> list[Reservation]:
        """The reservations touching ``worker_id``, oldest first."""
        ids = self._by_worker.get(worker_id)
        return [self._by_id[rid] for rid in ids] if ids else []

    def placed(self, worker_id: str, *, prefill: bool) -> Iterator[Reservation]:
        """Reservations that prefill (``prefill``) or decode on ``worker_id``, oldest
        first (a colocated plan decodes on its prefill worker)."""
        for r in self.on(worker_id):
            plan = r.plan
            if prefill:
                if plan.prefill_worker == worker_id and r.started_seq is None and not r.encoding:
                    yield r
            elif (plan.decode_worker or plan.prefill_worker) == worker_id:
                yield r


def worker_view(
    wid: str,
    s: WorkerReport,
    digest: frozenset[int],
    link: TransferCoeffs | None,
    theta: float,
    reserved: list[Reservation],
    previous: tuple[RunningRequest, ...] | None = None,
) -> WorkerView:
    """Worker ``wid`` as the policy sees it: report ``s`` with ``reserved`` (its
    reservations, oldest first) added; queued prompts classified by ``theta`` (short
    iff fewer tokens), and the encodes of those it encodes itself (a plan with images
    and no encode worker). ``previous``: the running tuple of the last view built from
    this same report, reused where its rows are the same objects."""
    short_tokens = long_tokens = num_short = num_long = 0
    for n in s.waiting_prompt_lens:
        if n < theta:
            short_tokens += n
            num_short += 1
        else:
            long_tokens += n
            num_long += 1
    queued_tokens = {LengthClass.SHORT: short_tokens, LengthClass.LONG: long_tokens}
    queued_requests = {LengthClass.SHORT: num_short, LengthClass.LONG: num_long}
    running = s.running
    num_free_blocks = s.num_free_blocks
    inbound_tokens = encoding_requests = encoding_tokens = 0
    encodes = s.waiting_image_tokens
    num_encodes, encode_tokens = len(encodes), sum(encodes)
    if reserved:
        added: list[RunningRequest] = []
        for r in reserved:
            started = r.started_seq is not None  # only where it runs: see ``start``
            if r.plan.prefill_worker == wid and not started:
                if r.encoding:  # not in the queue until its images land
                    encoding_requests += 1
                    encoding_tokens += r.prefill_tokens
                elif not r.queue_reported:  # else the report counts it
                    queued_tokens[r.length_class] += r.prefill_tokens
                    queued_requests[r.length_class] += 1
                    if r.image_tokens and r.plan.encode_worker is None:  # encoded here
                        num_encodes += 1
                        encode_tokens += r.image_tokens
            if r.plan.encode_worker == wid or r.encode_tokens:  # an encode queue: images
                share = r.image_tokens if r.encode_tokens is None else r.encode_tokens.get(wid, 0)
                queued_tokens[LengthClass.SHORT] += share
                queued_requests[LengthClass.SHORT] += 1 if share else 0
            if (r.plan.decode_worker or r.plan.prefill_worker) == wid:
                num_free_blocks -= math.ceil((r.held_tokens + 1) / s.block_size)
                row = r.running
                if row is None:
                    row = r.running = RunningRequest(r.held_tokens, 0, r.max_tokens)
                added.append(row)
                if r.plan.prefill_worker != wid and not started:  # its KV on the way here
                    inbound_tokens += r.held_tokens
        if added:
            if (
                previous is not None
                and len(previous) == len(running) + len(added)
                and all(map(operator.is_, previous[len(running) :], added))
            ):
                running = previous  # the same rows: the policy's caches key on the tuple
            else:
                running = (*running, *added)
    return WorkerView(
        worker_id=wid,
        role=s.role,
        num_total_blocks=s.num_total_blocks,
        num_free_blocks=max(0, num_free_blocks),
        block_size=s.block_size,
        queued_tokens=queued_tokens,
        queued_requests=queued_requests,
        # The report's own tuple when nothing is reserved here: the policy's per-worker
        # caches key on it, so a reservation released brings their old entry back.
        running=running,
        recent_steps=s.recent_steps,
        kv_bytes_per_token=s.kv_bytes_per_token,
        max_num_seqs=s.max_num_seqs,
        draining=s.draining,
        prefix_digest=digest,
        prefill_budget_tokens=s.prefill_budget_tokens,
        long_prefill_tokens=s.long_prefill_tokens,
        link_bandwidth_bytes_per_s=link.bandwidth_bytes_per_s if link else 0.0,
        link_latency_s=link.latency_s if link else None,
        inbound_tokens=inbound_tokens,
        queued_encodes=num_encodes,
        queued_encode_tokens=encode_tokens,
        encoding_requests=encoding_requests,
        encoding_tokens=encoding_tokens,
    )


def _encode_tokens(plan: Plan, profile: RequestProfile) -> dict[str, int] | None:
    """A split plan: each encode worker's share of the image tokens (by its images)."""
    if not plan.encode_parts:
        return None
    tokens = profile.tokens_per_image()
    shares: dict[str, int] = {}
    for wid, start, stop in plan.encode_parts:
        shares[wid] = shares.get(wid, 0) + round(part_tokens(tokens, start, stop))
    return shares
