"""The cluster as the policy sees it, kept incrementally: ``router.Router``'s view.

A worker's report (``update``) marks only that worker stale, and so does a change to
what is reserved on it, to its link or to θ's reading of its queue (``invalidate``);
``view`` rebuilds the stale workers' ``WorkerView`` and keeps every other worker's
object. The policy's per-worker caches (``WorkerTable.sync``) compare views by
identity, so a decision recomputes only the rows that moved.

A view is a worker's last report plus what is reserved on it (``router.reservations``,
``worker_view``), its link as measured (``router.links``) and its queued prompts
classified by the router's θ. The finished requests' output lengths (the estimator's
history H) are part of the view too: they are published ``_PUBLISH_OUTPUT_LENS_EVERY``
at a time.

A dead worker's later reports are ignored until ``revive``. The reservations, the links
and the classifier belong to the ``Router``; this module reads them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from router.length import LengthClassifier
from router.links import Links
from router.reservations import Reservations, worker_view
from router.types import ClusterView, WorkerReport, WorkerView

__all__ = ["LiveView"]

_OUTPUT_HISTORY = 256
# Finished output lengths reach the view (the estimator's history H) this many at a
# time: each new H is re-sorted and the policy's candidate ring redrawn. H is a window
# of hundreds, which 8 lengths move by a few percent. With a request ending per
# decision and each length published (when a new H also redrew the decode rows drawn
# against the old one), 64-worker live decisions took 219 µs p50, against 129 µs
# without endings (benchmarks/router.py, live); with both changes, 136 µs.
_PUBLISH_OUTPUT_LENS_EVERY = 8


@dataclass(slots=True)
class _Worker:
    report: WorkerReport
    digest: frozenset[int]
    view: WorkerView | None = None  # the last one built
    view_report: WorkerReport | None = None  # the report ``view`` was built from


class LiveView:
    def __init__(
        self, reservations: Reservations, links: Links, classifier: LengthClassifier
    ) -> None:
        self._reservations = reservations
        self._links = links
        self._classifier = classifier
        self._workers: dict[str, _Worker] = {}
        self._dead: set[str] = set()
        self._output_lens: deque[int] = deque(maxlen=_OUTPUT_HISTORY)
        self._output_tuple: tuple[int, ...] = ()
        self._num_unpublished = 0  # lengths observed since the view's H was built
        self._view: ClusterView | None = None
        # The view's workers in order; None: a worker joined or left, rebuild the order.
        self._slots: list[WorkerView] | None = None
        self._index: dict[str, int] = {}
        self._stale: set[str] = set()  # workers whose view must be rebuilt

    # -- telemetry ---------------------------------------------------------------------
    def update(self, report: WorkerReport) -> bool:
        """Take a worker's snapshot (False: ignored, from a dead worker or out of
        order); only that worker's view is rebuilt, lazily."""
        wid = report.worker_id
        if wid in self._dead:
            return False
        known = self._workers.get(wid)
        if known is not None and report.seq <= known.report.seq:
            return False
        if known is None:
            self._workers[wid] = _Worker(report, frozenset(report.prefix_digest))
            self._slots = None
        else:
            if known.report.prefix_digest != report.prefix_digest:
                known.digest = frozenset(report.prefix_digest)
            known.report = report
            self._reservations.counted(wid, report.seq)  # started there: counted now
        self._reservations.waiting(wid, report.waiting_request_ids)  # queued: counted now
        self.invalidate(wid)
        return True

    def mark_dead(self, worker_id: str) -> None:
        """Leave ``worker_id`` out of the view; its reports are ignored until ``revive``."""
        self._dead.add(worker_id)
        if self._workers.pop(worker_id, None) is not None:
            self._slots = None
            self._stale.discard(worker_id)
            self._view = None

    def revive(self, worker_id: str) -> None:
        self._dead.discard(worker_id)

    def invalidate(self, worker_id: str) -> None:
        """Something ``worker_id``'s view shows moved: rebuild it at the next ``view``."""
        if worker_id in self._workers:
            self._stale.add(worker_id)
            self._view = None

    def observe_output_len(self, output_len: int) -> None:
        """A finished request's output length: the view's H takes it with the next
        ``_PUBLISH_OUTPUT_LENS_EVERY`` (the first at once)."""
        self._output_lens.append(output_len)
        self._num_unpublished += 1
        if self._num_unpublished >= _PUBLISH_OUTPUT_LENS_EVERY or not self._output_tuple:
            self._num_unpublished = 0
            self._output_tuple = ()
            self._view = None

    # -- reading -----------------------------------------------------------------------
    def report(self, worker_id: str) -> WorkerReport | None:
        w = self._workers.get(worker_id)
        return None if w is None else w.report

    def reports(self) -> dict[str, WorkerReport]:
        return {wid: w.report for wid, w in self._workers.items()}

    def is_alive(self, worker_id: str) -> bool:
        return worker_id in self._workers

    def has_workers(self) -> bool:
        return bool(self._workers)

    def block_size(self) -> int | None:
        """The smallest KV block size among the live workers (None: no worker yet)."""
        sizes = [w.report.block_size for w in self._workers.values()]
        return min(sizes) if sizes else None

    def view(self) -> ClusterView:
        """The cluster as the policy sees it: telemetry plus reservations."""
        view = self._view
        if view is not None:
            return view
        if not self._output_tuple and self._output_lens:
            self._output_tuple = tuple(self._output_lens)
        slots = self._slots
        stale = self._stale
        if slots is None:
            self._index = {wid: i for i, wid in enumerate(self._workers)}
            slots = self._slots = []
            for wid, w in self._workers.items():
                if w.view is None or wid in stale:
                    w.view = self._worker_view(wid, w)
                slots.append(w.view)
        else:
            for wid in stale:
                w = self._workers[wid]
                w.view = slots[self._index[wid]] = self._worker_view(wid, w)
        stale.clear()
        view = self._view = ClusterView(tuple(slots), self._output_tuple)
        return view

    def _worker_view(self, wid: str, w: _Worker) -> WorkerView:
        last = w.view
        previous = last.running if last is not None and w.view_report is w.report else None
        w.view_report = w.report
        return worker_view(
            wid,
            w.report,
            w.digest,
            self._links.shown(wid),
            self._classifier.threshold_tokens,
            self._reservations.on(wid),
            previous,
        )
