"""Length classes (after LAPS): keep long prefills from holding up short ones.

A request's *effective prefill length* is its prompt tokens plus image tokens
minus the predicted prefix-cache hit. Below the threshold θ it is SHORT, else
LONG.

θ starts at the *knee* of the prefill curve ``a + b·n + c·n²``: the smallest
``n`` at which the token-dependent time ``b·n + c·n²`` equals the fixed overhead
``a`` (``cost_model.prefill_knee_tokens``), i.e. where a prefill stops costing
about the same whatever its length. It then adapts to the traffic by bounded
quantile tracking: θ follows the ``quantile`` (default 0.8) of recent effective
lengths by a multiplicative stochastic-approximation step, clamped to
``[knee / bound, knee × bound]`` so that it stays anchored to the hardware
while the few longest requests are always the ones set apart.

Two ways to separate the classes (``SplitMode``):

* ``temporal``: the classes share the workers that prefill, and the engines share
  their steps between them: each serves its queue first come, first served, but with
  a long-prefill threshold (``engine.long_prefill_token_threshold``) a long prompt
  goes in chunks and a short one that arrives behind it starts after one chunk
  (``queue_wait_s`` prices each worker's queue as its engine serves it).
* ``spatial``: the workers that prefill (prefill, then mixed ones) are split;
  a LONG pool takes LONG requests, the rest SHORT ones, each FCFS. The pool's
  size follows the LONG class's share of recent prefill work (``long_share``:
  seconds on the seed curve, over about ``share_window`` requests), so each class
  gets the workers its work needs: all of them when the other class is gone. (A
  fixed share of workers starved: on 2 prefill + 2 decode workers offered only
  long prompts, one prefill worker served them all while the other idled, and a
  worker the ratio planner moved to prefill or to mixed never took one.)
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence

import numpy as np

from router.cost_model import CostModel, prefill_knee_tokens
from router.profile import QuadCoeffs
from router.types import LengthClass, RequestProfile, Role, WorkerView

__all__ = [
    "LengthClassifier",
    "LongPool",
    "SplitMode",
    "effective_prefill_tokens",
    "long_pool_size",
    "prefill_curve",
    "queue_wait_s",
    "queue_waits_s",
    "queued_work_s",
]


MIN_CLASS_SHARE = 0.05  # of recent requests: a class that keeps a spatial pool worker
# A class not seen for this many of its mean gaps (1 / its share, in requests) is gone.
GONE_AFTER_GAPS = 10.0
_PRIOR_REQUESTS = 5.0  # what the prior class shares weigh, in requests


class SplitMode(enum.StrEnum):
    TEMPORAL = "temporal"
    SPATIAL = "spatial"


def effective_prefill_tokens(profile: RequestProfile, hit_tokens: int | None = None) -> int:
    """Prompt + image tokens − prefix hit (``None``: the gateway's predicted hit)."""
    if hit_tokens is None:
        return profile.num_new_tokens + profile.num_image_tokens
    total = profile.num_prompt_tokens + profile.num_image_tokens
    return max(1, total - hit_tokens)


class LengthClassifier:
    """θ and the SHORT/LONG decision; ``observe`` adapts θ unless it was fixed."""

    def __init__(
        self,
        prefill: QuadCoeffs,
        threshold_tokens: int | None = None,
        quantile: float = 0.8,
        step: float = 0.05,
        bound: float = 4.0,
        min_tokens: float = 16.0,
        max_tokens: float = 65536.0,
        prior_long_share: float = 0.25,
        share_window: int = 50,
        request_window: int = 20,
    ) -> None:
        if not 0 < quantile < 1 or step <= 0 or bound < 1:
            raise ValueError("need 0 < quantile < 1, step > 0, bound >= 1")
        if not 0 <= prior_long_share <= 1 or min(share_window, request_window) < 1:
            raise ValueError("need 0 <= prior_long_share <= 1 and windows >= 1")
        knee = min(max(prefill_knee_tokens(prefill), min_tokens), max_tokens)
        self._prefill = prefill
        self.knee_tokens = knee
        self.adaptive = threshold_tokens is None
        self._theta = float(threshold_tokens) if threshold_tokens is not None else knee
        self._lo = knee / bound
        self._hi = knee * bound
        self._quantile = quantile
        self._step = step
        # Prefill work and requests by class (SHORT, LONG), decayed per request over
        # about ``share_window`` and ``request_window`` requests (whether a class still
        # comes is known sooner than its share of the work); the prior weighs as a few
        # knee-long requests.
        self._work_decay = 1.0 - 1.0 / share_window
        self._request_decay = 1.0 - 1.0 / request_window
        prior = (1.0 - prior_long_share, prior_long_share)
        self._requests = [_PRIOR_REQUESTS * x for x in prior]
        self._work = [_PRIOR_REQUESTS * self._work_s(knee) * x for x in prior]
        self._since = [0, 0]  # requests since the last of each class (the prior: just now)
        # Each class's mean gap between requests (1 / its share) when last seen.
        self._gap = [1.0 / max(x, 1e-9) for x in prior]

    def _work_s(self, num_tokens: float) -> float:
        return max(self._prefill.at(num_tokens), 1e-12)

    @property
    def long_share(self) -> float:
        """The LONG class's share of recent prefill work (seconds on the seed curve)."""
        short, long = self._work
        return long / (short + long)

    @property
    def long_request_share(self) -> float:
        """The LONG class's share of recent requests."""
        short, long = self._requests
        return long / (short + long)

    @property
    def present_request_shares(self) -> tuple[float, float]:
        """(SHORT, LONG) shares of recent requests, 0 for a class that is gone: one not
        seen for ``GONE_AFTER_GAPS`` of its mean gaps (``1 / share`` requests, its share
        when last seen). A class still coming at its share is judged gone before
        about 1% of its requests at a 5% share, 0.1% at 10% (e^-10, with the share's
        noise); ``router.Router`` observes a request before it places it, so that
        request finds its class present again. (At 6 gaps, a 45%/55% mix saw a class
        judged gone in a quarter of 600-request runs: long prompts then took the short
        prompts' worker too, and live, short prompts queued behind them.) Every arrival
        must be observed, placed or not (``Router.arrive``): live, long prompts that
        waited in the gateway's hold line behind a held one went unseen, the long
        class was judged gone while its prompts were held, and they were placed on the
        short prompts' worker.

        The decayed share alone forgets slowly: from all of the requests to under
        ``MIN_CLASS_SHARE`` takes 58 of the other class. After a phase of short prompts
        the short class kept a spatial pool worker of its own, idle, through a whole
        live phase of long ones (2 mixed workers, 53 long prompts, one worker took
        them). A class that stops is gone after about 11 requests of the other."""
        (short, long), since, gap = self._requests, self._since, self._gap
        total = short + long
        return (
            0.0 if since[0] > GONE_AFTER_GAPS * gap[0] else short / total,
            0.0 if since[1] > GONE_AFTER_GAPS * gap[1] else long / total,
        )

    @property
    def threshold_tokens(self) -> float:
        return self._theta

    def classify(self, num_tokens: float) -> LengthClass:
        return LengthClass.SHORT if num_tokens < self._theta else LengthClass.LONG

    def observe(self, num_tokens: float) -> None:
        """Move θ toward the tracked quantile (at equilibrium P(n < θ) = quantile),
        then count the request's prefill work in its class."""
        if self.adaptive:
            above = 1.0 if num_tokens >= self._theta else 0.0
            theta = self._theta * math.exp(self._step * (above - (1.0 - self._quantile)))
            self._theta = min(max(theta, self._lo), self._hi)
        cls = 1 if num_tokens >= self._theta else 0
        work, requests = self._work, self._requests
        work[0] *= self._work_decay
        work[1] *= self._work_decay
        requests[0] *= self._request_decay
        requests[1] *= self._request_decay
        work[cls] += self._work_s(num_tokens)
        requests[cls] += 1.0
        self._since[cls] = 0
        self._since[1 - cls] += 1
        self._gap[cls] = (requests[0] + requests[1]) / requests[cls]


def queue_wait_s(
    coeffs: QuadCoeffs,
    queued_tokens: Mapping[LengthClass, int],
    queued_requests: Mapping[LengthClass, int],
    length_class: LengthClass,
    budget_tokens: int = 0,
    long_prefill_tokens: int = 0,
) -> float:
    """Predicted time before a new request of ``length_class`` starts prefilling, behind
    a worker's queue as its engine serves it: first come, first served, except that
    with a long-prefill threshold (``long_prefill_tokens``, the engine's
    ``long_prefill_token_threshold``; 0: none) no request takes more than that many
    tokens of a step while others wait, so a SHORT request that arrives behind long
    prompts waits for the queued SHORT work and one chunk of each long prompt (they
    share its first steps), not for the long prompts themselves. A LONG request waits
    for everything queued.

    Each class's queued work is priced as ``s·a + b·T + c·T²/k`` for ``k`` requests of
    ``T`` tokens in all (the quadratic term as if equally long). The engine fills steps
    of at most ``budget_tokens`` tokens from the queue, batching short prompts and
    chunking long ones, and pays the fixed overhead ``a`` once per step, so
    ``s = ⌈T / budget⌉``; with no known budget (0) every request is taken to be its own
    step, which over-prices a queue of short prompts by up to ``k`` times ``a``.
    (``s = min(k, ⌈T / budget⌉)`` priced a chunked queue of long prompts as one step
    each: on a mixed worker, whose budget is 512 tokens less its running sequences,
    three queued 2250-token prompts took 19 steps of ~12 ms where 3 were priced.)"""
    short_s, long_s = queue_waits_s(
        coeffs, queued_tokens, queued_requests, budget_tokens, long_prefill_tokens
    )
    return short_s if length_class is LengthClass.SHORT else long_s


def queue_waits_s(
    coeffs: QuadCoeffs,
    queued_tokens: Mapping[LengthClass, int],
    queued_requests: Mapping[LengthClass, int],
    budget_tokens: int = 0,
    long_prefill_tokens: int = 0,
) -> tuple[float, float]:
    """``queue_wait_s`` of a SHORT and of a LONG request (a worker's row needs both)."""
    short_tokens = queued_tokens.get(LengthClass.SHORT, 0)
    long_tokens = queued_tokens.get(LengthClass.LONG, 0)
    num_short = max(queued_requests.get(LengthClass.SHORT, 1), 1)
    num_long = max(queued_requests.get(LengthClass.LONG, 1), 1)
    short_s = queued_work_s(coeffs, budget_tokens, short_tokens, num_short)
    long_s = short_s + queued_work_s(coeffs, budget_tokens, long_tokens, num_long)
    chunks = num_long * long_prefill_tokens  # one chunk of each long prompt
    if long_prefill_tokens <= 0 or long_tokens <= chunks:
        return long_s, long_s  # first come, first served (or each long prompt is one chunk)
    # The queued SHORT work and the chunks run together in the SHORT request's steps.
    tokens = short_tokens + chunks
    steps = _num_steps(budget_tokens, tokens, num_long + (num_short if short_tokens > 0 else 0))
    squares = float(num_long * long_prefill_tokens * long_prefill_tokens)
    if short_tokens > 0:
        squares += short_tokens * short_tokens / num_short
    return steps * coeffs.a + coeffs.b * tokens + coeffs.c * squares, long_s


def queued_work_s(coeffs: QuadCoeffs, budget_tokens: int, tokens: int, count: int) -> float:
    """``s·a + b·T + c·T²/k`` for ``k`` queued requests of ``T`` tokens in all."""
    if tokens <= 0:
        return 0.0
    steps = _num_steps(budget_tokens, tokens, count)
    return steps * coeffs.a + coeffs.b * tokens + coeffs.c * tokens * tokens / count


def _num_steps(budget_tokens: int, tokens: int, count: int) -> int:
    """Steps the engine takes for ``tokens`` of ``count`` prompts: ``⌈tokens / budget⌉``,
    or one a prompt where the budget is unknown (0)."""
    return -(-tokens // budget_tokens) if budget_tokens > 0 else count


def prefill_curve(
    w: WorkerView, model: CostModel, held: float
) -> tuple[QuadCoeffs, QuadCoeffs, int]:
    """(one request's prefill curve, the queue's per-step curve, step budget) as
    this worker actually prefills.

    A prefill worker runs prompts in steps of ``prefill_budget_tokens``. A worker
    that also decodes (chunked prefill) gives each step's budget to its running
    sequences first, one token each, and prefills in the rest, and every such step
    lasts a decode step too: ``n`` tokens take ``⌈n / chunk⌉`` steps of
    ``max(a_p, a_d) + b_d·B + c_d·ΣL`` plus the token terms. Pricing it like a
    prefill worker made a busy decode worker look far faster for a long prompt
    than it is (0.2 s predicted where the chunks took seconds)."""
    coeffs, budget = model.prefill_coeffs, w.prefill_budget_tokens
    if w.role is Role.PREFILL or budget <= 0 or not w.running:
        return coeffs, coeffs, budget
    dec = model.decode_coeffs
    num_running = len(w.running)
    chunk = max(1, budget - num_running)
    step_s = max(coeffs.a, dec.a) + dec.b * num_running + dec.c * held
    # One request: ⌈n / chunk⌉·step ≤ step + n·step / chunk, folded into a and b.
    own = QuadCoeffs(step_s, coeffs.b + step_s / chunk, coeffs.c)
    return own, QuadCoeffs(step_s, coeffs.b, coeffs.c), chunk


class LongPool:
    """The spatial split's LONG pool over a table's workers: ``size`` of the workers
    that prefill, prefill workers first (by sorted id, from the last), then mixed ones
    (whose decodes a long prompt's chunks would stall).

    ``order`` ranks the hosts once per set of workers (a join, a leave or a flip
    rebuilds the table); a new size then costs one comparison per worker. Sorting
    the hosts at every resize took 0.3-0.4 ms at 1024 workers, in about one decision
    of 25 on a noisy share (``benchmarks/router.py``, live)."""

    def __init__(self) -> None:
        self.size = 0
        self._num_hosts = 0
        self._sized = False
        self._rank = np.zeros(0, dtype=np.int64)  # each worker's place among the hosts, or -1

    def resize(self, long_share: float, request_shares: tuple[float, float]) -> bool:
        """Size it to the shares (``long_pool_size``); whether the size changed."""
        current = min(self.size, self._num_hosts) if self._sized else None
        size = long_pool_size(long_share, request_shares, self._num_hosts, current)
        self._sized = True
        changed, self.size = size != self.size, size
        return changed

    def order(self, workers: Sequence[WorkerView]) -> None:
        """Rank the hosts among ``workers``: the pool takes them from the last."""
        hosts = sorted(
            (i for i, w in enumerate(workers) if w.role in (Role.PREFILL, Role.MIXED)),
            key=lambda i: (workers[i].role is Role.PREFILL, workers[i].worker_id),
        )
        self._rank = np.full(len(workers), -1, dtype=np.int64)
        self._rank[hosts] = np.arange(len(hosts))
        self._num_hosts = len(hosts)

    def members(self) -> tuple[np.ndarray, bool]:
        """Which of the ranked workers are in the pool, and whether every host is."""
        self.size = min(self.size, self._num_hosts)
        in_pool: np.ndarray = self._rank >= self._num_hosts - self.size  # non-hosts: -1
        return in_pool, self.size == self._num_hosts


def long_pool_size(
    long_share: float,
    request_shares: tuple[float, float],
    num_hosts: int,
    current: int | None,
) -> int:
    """How many of ``num_hosts`` prefilling workers form the LONG pool: the LONG
    class's share of the work, rounded; the current size (None: none yet) stands while
    it is within 0.75 workers, or 5% of the hosts, of that, so that a share near a half
    does not move a worker back and forth, nor the noise of the share move a large
    pool at every request. A class that still brings ``MIN_CLASS_SHARE`` of the requests
    (``request_shares``: SHORT, LONG; 0 for a class gone,
    ``LengthClassifier.present_request_shares``) keeps a worker of its own while there
    are two to share; a class gone has no work left (the decayed work share forgets it
    over about 50 requests)."""
    short_request_share, long_request_share = request_shares
    if not short_request_share:  # the short class is gone, and its work with it
        long_share = 1.0
    elif not long_request_share:
        long_share = 0.0
    target = long_share * num_hosts
    size = current
    hold = max(0.75, 0.05 * num_hosts)
    if size is None or size > num_hosts or abs(target - size) > hold:
        size = min(num_hosts, math.floor(target + 0.5))
    if long_request_share >= MIN_CLASS_SHARE:
        size = max(size, min(1, num_hosts))
    if short_request_share >= MIN_CLASS_SHARE and num_hosts >= 2:
        size = min(size, num_hosts - 1)
    return size
