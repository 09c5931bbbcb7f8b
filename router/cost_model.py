"""How long prefill, a decode step, an encode and a KV transfer take, per worker.

Functional forms (DistServe's):

* prefill of ``n`` new tokens: ``a + b·n + c·n²`` seconds;
* one decode step of batch ``B`` with total context ``ΣL``: ``a + b·B + c·ΣL`` seconds;
* a transfer of ``bytes``: ``bytes / bandwidth + latency`` seconds;
* an encode of ``m`` image tokens: ``a + b·m`` seconds (optional).

A ``CostModel`` is seeded from a ``Profile`` and refitted online from the
``StepSample`` telemetry of its worker by weighted least squares over a rolling
window (newer steps weigh more, the profile acts as a ridge prior so a model
with few samples stays near its seed). It tracks its own prediction error
(the rolling mean of how much slower than predicted its steps ran, relative to
their duration; faster steps count as no error) so that predictions carry it.

A step that also encoded images (``StepSample.num_encodes``: an engine that encodes a
prompt's images in the step that prefills it, as vLLM does) is fitted without them: its
encodes are priced by the profile's encode term (``encodes_s``) and taken off its
duration first. Fitted in, they made a colocated worker's prefill of an image prompt
an encode slower than it is, and ``slo_goodput``, which adds the encode itself, counted
it twice: in the simulator (InternVL2-26B, 13 prefill + 3 decode, 2-8 images a
request) image requests' TTFT was over-predicted by a median 108 ms at 30 req/s and
7% of all requests were refused as unreachable that would have met a 500 ms target.

The seed and its file format are ``router.profile``.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from router.profile import Profile, QuadCoeffs
from router.types import StepSample

__all__ = ["CostModel", "Prediction", "prefill_knee_tokens"]


@dataclass(frozen=True, slots=True)
class Prediction:
    """A predicted duration and the model's recent relative error (steps slower than predicted)."""

    value_s: float
    rel_error: float

    @property
    def upper_s(self) -> float:
        return self.value_s * (1.0 + self.rel_error)


class _RollingMean:
    """Mean of the last ``size`` values in O(1)."""

    def __init__(self, size: int) -> None:
        self._values: deque[float] = deque(maxlen=size)
        self._total = 0.0

    def add(self, value: float) -> None:
        if len(self._values) == self._values.maxlen:
            self._total -= self._values[0]
        self._values.append(value)
        self._total += value

    @property
    def mean(self) -> float:
        return self._total / len(self._values) if self._values else 0.0


# Features of one step: [1{n>0}, n, n², 1{B>0, n=0}, B, ΣL]; coefficients
# [prefill a, b, c, decode a, b, c]. Pure prefill steps and pure decode steps decouple
# into the two curves. A mixed step is one pass over the weights: it pays one fixed
# cost, prefill's, plus both curves' token terms. (Modelled as the sum of both curves,
# a mixed worker's fit, mostly mixed steps that pay ~6.5 ms once, split that cost
# between the two a's: decode a came out at 1.7 ms, its plain decode steps then ran
# "3.5x slower than modelled" and admission refused every prompt on the grounds of
# TPOT; phase_shift at 256 GPUs all mixed, 1242 of 6000 refused.)
_NUM_FEATURES = 6


def _features(n: float, num_seqs: float, context: float) -> list[float]:
    return [float(n > 0), n, n * n, float(num_seqs > 0 and n <= 0), num_seqs, context]


@dataclass
class CostModel:
    """One worker's cost model; ``observe`` feeds it, the getters read the fitted curves.

    ``window`` steps are kept; a step ``k`` steps old weighs ``decay**k``. The
    profile is a ridge prior worth ``prior_weight`` steps at the reference point
    (``ref_tokens`` prefill tokens, ``ref_seqs`` sequences, ``ref_context`` tokens).
    """

    profile: Profile
    window: int = 256
    decay: float = 0.995
    prior_weight: float = 0.01
    refit_every: int = 8
    error_window: int = 64
    ref_tokens: float = 512.0
    ref_seqs: float = 32.0
    ref_context: float = 32.0 * 1024.0
    # The window as a ring: row ``_head`` is the oldest once ``num_kept == window``.
    _x: np.ndarray = field(init=False, repr=False)
    _y: np.ndarray = field(init=False, repr=False)
    _head: int = field(default=0, init=False, repr=False)
    num_kept: int = field(default=0, init=False, repr=False)
    _weights: np.ndarray | None = field(default=None, init=False, repr=False)
    _theta: np.ndarray = field(init=False, repr=False)
    _theta0: np.ndarray = field(init=False, repr=False)
    _coeffs: tuple[QuadCoeffs, QuadCoeffs] = field(init=False, repr=False)
    _since_fit: int = field(default=0, init=False, repr=False)
    _prefill_err: _RollingMean = field(init=False, repr=False)
    _decode_err: _RollingMean = field(init=False, repr=False)
    # The fit's constants (the reference point, the prior's weights and its pull toward
    # the seed): they depend on the profile and the settings only, so ``refit`` reads them.
    _ref: np.ndarray = field(init=False, repr=False)
    _prior_diag: np.ndarray = field(init=False, repr=False)
    _prior_pull: np.ndarray = field(init=False, repr=False)
    num_samples: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        p, d = self.profile.prefill, self.profile.decode
        self._theta0 = np.array([p.a, p.b, p.c, d.a, d.b, d.c], dtype=np.float64)
        self._set_theta(self._theta0.copy())
        self._x = np.empty((self.window, _NUM_FEATURES))
        self._y = np.empty(self.window)
        self._prefill_err = _RollingMean(self.error_window)
        self._decode_err = _RollingMean(self.error_window)
        self._ref = np.array(
            [1.0, self.ref_tokens, self.ref_tokens**2, 1.0, self.ref_seqs, self.ref_context]
        )
        at_ref = self._theta0 * self._ref
        curve_s = np.repeat([at_ref[:3].sum(), at_ref[3:].sum()], 3)
        prior = self.prior_weight / np.maximum(curve_s, 1e-12) ** 2
        self._prior_diag = np.diag(prior)
        self._prior_pull = prior * at_ref

    # -- feeding -----------------------------------------------------------------------

    def observe(self, sample: StepSample) -> None:
        if sample.duration_s <= 0 or (
            sample.num_prefill_tokens <= 0 and sample.num_decode_seqs <= 0
        ):
            return
        # What the step took beside its encodes (see the module); none left: the encode
        # term explains the whole step, which then says nothing of its prefill.
        duration_s = sample.duration_s - self.encodes_s(sample)
        if duration_s <= 0:
            return
        x = _features(
            sample.num_prefill_tokens, sample.num_decode_seqs, sample.total_context_tokens
        )
        predicted = float(np.dot(self._theta, x))
        # One-sided: the margin guards against steps slower than predicted. A step faster
        # than predicted is no error to pad against: counted, a seed profile 17x slower
        # than a fast CPU engine made a 17x margin, which priced an idle decode worker past
        # its TPOT target, refused every request and so never saw the steps to correct it.
        rel_error = max(0.0, duration_s - predicted) / duration_s
        if sample.num_prefill_tokens > 0:
            self._prefill_err.add(rel_error)
        else:
            self._decode_err.add(rel_error)
        if self.num_kept < self.window:
            row = self.num_kept
            self.num_kept += 1
        else:
            row = self._head
            self._head = (row + 1) % self.window
        self._x[row] = x
        self._y[row] = duration_s
        self.num_samples += 1
        self._since_fit += 1
        # Every step while the window is young: a prefill worker steps about once a
        # prompt, and seeded with a GPU's profile its first 8 prefills (20 s at 1 req/s
        # shared by two) were priced 20x faster than they ran: live, the ratio of its
        # steps to that model refused 3 of a first 20 prompts on "prefill speed".
        if self._since_fit >= self.refit_every or self.num_kept <= self.refit_every:
            self.refit()

    def refit(self) -> None:
        """Weighted ridge least squares toward the profile over the window.

        Residuals are relative (weight ``1/y²``): step noise is multiplicative, and
        a 1 % wobble of an 8k-token prefill would otherwise swamp the fixed cost.
        The prior penalises each term's change at the reference point relative to
        the curve's time there, ``prior_weight`` steps' worth."""
        self._since_fit = 0
        kept = self.num_kept
        if not kept:
            return
        if kept < self.window:
            x, y = self._x[:kept], self._y[:kept]
        else:  # oldest first, as the steps came
            head = self._head
            x = np.concatenate((self._x[head:], self._x[:head]))
            y = np.concatenate((self._y[head:], self._y[:head]))
        weights = self._decay_weights(kept) / (y * y)
        ref = self._ref
        # Solve for theta·ref (columns scaled to the reference point): well conditioned.
        xs = x / ref
        xw = xs * weights[:, None]
        gram = xw.T @ xs + self._prior_diag
        rhs = xw.T @ y + self._prior_pull
        self._set_theta(_solve_non_negative(gram, rhs) / ref)

    def _decay_weights(self, num_steps: int) -> np.ndarray:
        """``decay**k`` for the steps oldest first (k steps old): the newest ``num_steps``
        of a full window's, computed once."""
        weights = self._weights
        if weights is None:
            weights = self._weights = self.decay ** np.arange(
                self.window - 1, -1, -1, dtype=np.float64
            )
        return weights[self.window - num_steps :]

    # -- reading -----------------------------------------------------------------------

    @property
    def prefill_coeffs(self) -> QuadCoeffs:
        return self._coeffs[0]

    @property
    def decode_coeffs(self) -> QuadCoeffs:
        return self._coeffs[1]

    def _set_theta(self, theta: np.ndarray) -> None:
        self._theta = theta
        a, b, c, da, db, dc = (float(v) for v in theta)
        self._coeffs = (QuadCoeffs(a, b, c), QuadCoeffs(da, db, dc))

    @property
    def prefill_error(self) -> float:
        """Rolling mean relative error (slower than predicted) of steps that prefilled."""
        return self._prefill_err.mean

    @property
    def decode_error(self) -> float:
        """Rolling mean relative error (slower than predicted) of decode-only steps."""
        return self._decode_err.mean

    def prefill_s(self, num_tokens: float) -> float:
        a, b, c = self._theta[:3]
        return float(a + num_tokens * (b + num_tokens * c)) if num_tokens > 0 else 0.0

    def step_s(self, num_prefill_tokens: float, num_seqs: float, context_tokens: float) -> float:
        """One step that prefills ``num_prefill_tokens`` and decodes ``num_seqs``
        sequences holding ``context_tokens`` (either may be 0): a mixed step pays one
        fixed cost."""
        return float(np.dot(self._theta, _features(num_prefill_tokens, num_seqs, context_tokens)))

    def decode_step_s(self, num_seqs: float, context_tokens: float) -> float:
        a, b, c = self._theta[3:]
        return float(a + b * num_seqs + c * context_tokens) if num_seqs > 0 else 0.0

    def transfer_s(self, num_bytes: float, bandwidth_bytes_per_s: float | None = None) -> float:
        link = self.profile.transfer
        bandwidth = bandwidth_bytes_per_s or link.bandwidth_bytes_per_s
        return num_bytes / bandwidth + link.latency_s if num_bytes > 0 else 0.0

    def encode_s(self, num_image_tokens: float) -> float:
        return self.profile.encode.encode_s(num_image_tokens)

    def encodes_s(self, sample: StepSample) -> float:
        """The encodes that ran inside ``sample``'s step (``encode_work_s``)."""
        return self.encode_work_s(sample.num_encodes, sample.num_encoded_image_tokens)

    def encode_work_s(self, num_encodes: int, num_image_tokens: int) -> float:
        """``num_encodes`` requests' encodes of ``num_image_tokens`` image tokens in all,
        by the profile's encode term: ``a`` per request, ``b`` per image token."""
        if num_image_tokens <= 0:
            return 0.0
        encode = self.profile.encode
        return encode.a * num_encodes + encode.b * num_image_tokens

    def sample_s(self, sample: StepSample) -> float:
        """The modelled duration of ``sample``'s step: ``step_s`` of its work plus the
        encodes that ran inside it (``encodes_s``)."""
        work_s = self.step_s(
            sample.num_prefill_tokens, sample.num_decode_seqs, sample.total_context_tokens
        )
        return work_s + self.encodes_s(sample)

    def predict_prefill(self, num_tokens: float) -> Prediction:
        return Prediction(self.prefill_s(num_tokens), self.prefill_error)

    def predict_decode_step(self, num_seqs: float, context_tokens: float) -> Prediction:
        return Prediction(self.decode_step_s(num_seqs, context_tokens), self.decode_error)


def _solve_non_negative(gram: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """``gram·θ = rhs`` with every term of ``θ`` at least 0: no part of a step's time is
    negative. A term the unconstrained solve makes negative is held at 0 and the others
    are solved again, until none is. Unconstrained, a fit over a narrow range of ``n``
    (a mixed worker's chunks are all about its budget) extrapolates to nonsense: on the
    phase-shift workload, all mixed, the prefill ``c`` came out at -3.5e-8 and a
    2250-token prompt was priced at -0.08 s, so every long prompt went to that worker
    (TTFT up to 15 s, attainment 0.18 in the prefill-heavy third)."""
    free = np.ones(len(rhs), dtype=bool)
    theta = np.zeros(len(rhs))
    for _ in range(len(rhs)):
        theta[:] = 0.0
        if free.all():  # the usual case, and the first pass: the whole system, no copy
            theta[:] = np.linalg.solve(gram, rhs)
        else:
            theta[free] = np.linalg.solve(gram[np.ix_(free, free)], rhs[free])
        negative = theta < 0
        if not negative.any():
            break
        free &= ~negative
    return np.maximum(theta, 0.0)


def prefill_knee_tokens(coeffs: QuadCoeffs, fixed_multiple: float = 1.0) -> float:
    """Smallest ``n`` where the token-dependent time ``b·n + c·n²`` reaches
    ``fixed_multiple × a``: below it a prefill costs about its fixed overhead
    (the curve is flat in ``n``), above it time grows with the prompt."""
    target = fixed_multiple * max(coeffs.a, 0.0)
    if coeffs.c > 0:
        return (-coeffs.b + math.sqrt(coeffs.b**2 + 4 * coeffs.c * target)) / (2 * coeffs.c)
    if coeffs.b > 0:
        return target / coeffs.b
    return math.inf
