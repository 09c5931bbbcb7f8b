"""Cost model: profile format, online refit recovering known coefficients, error tracking."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from router.cost_model import CostModel, Prediction, prefill_knee_tokens
from router.profile import (
    DEFAULT_PROFILE,
    EncodeCoeffs,
    Profile,
    QuadCoeffs,
    load_profile,
    save_profile,
)
from router.types import StepSample

TRUE_PREFILL = QuadCoeffs(a=0.02, b=2.0e-4, c=3.0e-8)
TRUE_DECODE = QuadCoeffs(a=0.01, b=3.0e-4, c=5.0e-8)


def synthetic_steps(count: int, seed: int = 0, noise: float = 0.01) -> list[StepSample]:
    rng = random.Random(seed)
    steps = []
    for k in range(count):
        if k % 2 == 0:
            n = rng.randint(16, 8192)
            t = TRUE_PREFILL.a + TRUE_PREFILL.b * n + TRUE_PREFILL.c * n * n
            sample = StepSample(t * (1 + rng.gauss(0, noise)), n, 0, 0, end_s=float(k))
        else:
            batch = rng.randint(1, 128)
            context = batch * rng.randint(100, 3000)
            t = TRUE_DECODE.a + TRUE_DECODE.b * batch + TRUE_DECODE.c * context
            sample = StepSample(t * (1 + rng.gauss(0, noise)), 0, batch, context, end_s=float(k))
        steps.append(sample)
    return steps


def _close(fitted: QuadCoeffs, true: QuadCoeffs, rel: float) -> None:
    for name in "abc":
        assert getattr(fitted, name) == pytest.approx(getattr(true, name), rel=rel), name


def test_fit_recovers_known_coefficients_within_5_percent() -> None:
    model = CostModel(DEFAULT_PROFILE)  # seeded far from the truth
    with pytest.raises(AssertionError):
        _close(model.prefill_coeffs, TRUE_PREFILL, 0.05)
    for sample in synthetic_steps(600):
        model.observe(sample)
    model.refit()
    _close(model.prefill_coeffs, TRUE_PREFILL, 0.05)
    _close(model.decode_coeffs, TRUE_DECODE, 0.05)


def test_prediction_error_is_tracked_and_shrinks_after_the_fit() -> None:
    model = CostModel(DEFAULT_PROFILE, error_window=32)
    steps = synthetic_steps(600)
    for sample in steps[:6]:  # before the first refit
        model.observe(sample)
    early = model.prefill_error
    for sample in steps[6:]:
        model.observe(sample)
    assert early > 0.2  # the seed profile is a different machine
    assert model.prefill_error < 0.05 and model.decode_error < 0.05
    pred = model.predict_prefill(1000)
    assert isinstance(pred, Prediction)
    assert pred.value_s == pytest.approx(model.prefill_s(1000))
    assert pred.upper_s == pytest.approx(pred.value_s * (1 + model.prefill_error))


def test_few_samples_stay_near_the_seed() -> None:
    model = CostModel(DEFAULT_PROFILE)
    for sample in synthetic_steps(4):
        model.observe(sample)
    model.refit()
    # Decode saw two steps only: the ridge prior keeps it on the profile's scale.
    seed = DEFAULT_PROFILE.decode
    assert model.decode_coeffs.a == pytest.approx(seed.a, rel=0.5)


def test_curves_and_transfer() -> None:
    p = replace(
        DEFAULT_PROFILE,
        prefill=QuadCoeffs(0.01, 1e-4, 1e-8),
        decode=QuadCoeffs(0.005, 1e-4, 1e-7),
    )
    model = CostModel(p)
    assert model.prefill_s(1000) == pytest.approx(0.01 + 0.1 + 0.01)
    assert model.prefill_s(0) == 0.0
    assert model.decode_step_s(10, 5000) == pytest.approx(0.005 + 0.001 + 0.0005)
    link = p.transfer
    expected = 1e9 / link.bandwidth_bytes_per_s + link.latency_s
    assert model.transfer_s(1e9) == pytest.approx(expected)
    assert model.transfer_s(1e9, bandwidth_bytes_per_s=1e10) == pytest.approx(0.1 + link.latency_s)


def test_profile_round_trip_and_missing_field(tmp_path) -> None:
    path = tmp_path / "p.json"
    save_profile(DEFAULT_PROFILE, path)
    assert load_profile(path) == DEFAULT_PROFILE
    data = json.loads(path.read_text())
    del data["encode"]  # optional
    assert Profile.from_dict(data).encode.a == 0.0
    del data["decode"]
    with pytest.raises(ValueError, match="decode"):
        Profile.from_dict(data)


def test_knee_is_where_token_time_equals_fixed_time() -> None:
    assert prefill_knee_tokens(QuadCoeffs(0.02, 1e-4, 0.0)) == pytest.approx(200)
    n = prefill_knee_tokens(QuadCoeffs(0.02, 1e-4, 1e-7))
    assert 1e-4 * n + 1e-7 * n * n == pytest.approx(0.02)
    assert n < 200


PROFILES = Path(__file__).parents[3] / "loadgen" / "profiles"
SHIPPED = sorted(PROFILES.glob("*.json"))


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_profiles_parse_and_are_physical(path: Path) -> None:
    profile = load_profile(path)
    model = CostModel(profile)
    assert model.prefill_s(2048) > model.prefill_s(16) > 0
    assert model.decode_step_s(64, 64 * 1024) > model.decode_step_s(1, 1024) > 0
    assert profile.kv_bytes_per_token > 0 and profile.transfer.bandwidth_bytes_per_s > 0


# A mixed worker's steps in the simulator (llama3-8b on H100, the phase-shift workload, all
# workers mixed): (duration_s, prefill tokens, decode sequences, context), in order. Its
# chunks are all about its 512-token budget, so the prefill curve's n² term is barely
# determined by them.
MIXED_CHUNK_STEPS = [
    (0.01894, 512, 0, 0),
    (0.01917, 512, 0, 0),
    (0.0194, 512, 0, 0),
    (0.01549, 368, 0, 1905),
    (0.02053, 511, 1, 1906),
    (0.02076, 511, 1, 1907),
    (0.02099, 511, 1, 1908),
    (0.02122, 511, 1, 1909),
    (0.01518, 296, 1, 4251),
    (0.02064, 510, 2, 4253),
    (0.02087, 510, 2, 4255),
    (0.02109, 510, 2, 4257),
    (0.00732, 20, 2, 5810),
    (0.00685, 0, 3, 3472),
    (0.00671, 0, 2, 1564),
    (0.0066, 0, 1, 1567),
    (0.00781, 45, 1, 1614),
    (0.00662, 0, 2, 46),
    (0.00652, 0, 1, 62),
    (0.00806, 57, 1, 132),
    (0.00936, 104, 2, 239),
    (0.00661, 0, 3, 406),
    (0.0066, 0, 2, 526),
    (0.00655, 0, 1, -18),
]


def test_a_fit_over_chunks_of_one_size_keeps_every_term_non_negative() -> None:
    # Fitted freely, c came out at -1.0e-8 and a 2250-token prompt was priced at 0.032 s,
    # half its 0.068 s; the router sent every long prompt to that worker.
    profile = load_profile(PROFILES / "llama3-8b-h100.json")
    model = CostModel(profile)
    for k, (duration_s, n, num_seqs, context) in enumerate(MIXED_CHUNK_STEPS):
        model.observe(StepSample(duration_s, n, num_seqs, context, end_s=float(k)))
    model.refit()
    for coeffs in (model.prefill_coeffs, model.decode_coeffs):
        assert min(coeffs.a, coeffs.b, coeffs.c) >= 0.0
    p = profile.prefill  # the simulator's law for those steps
    assert model.prefill_s(2250) == pytest.approx(p.a + p.b * 2250 + p.c * 2250**2, rel=0.15)


def test_a_mixed_step_pays_one_fixed_cost_so_plain_decode_steps_stay_priced() -> None:
    # A mixed worker's steps, mostly mixed, as an engine runs them: one pass over the
    # weights, so one fixed cost (the larger). Modelled as the sum of a prefill and a
    # decode step, the fit split that cost between the two a's and priced a plain
    # decode step at a third of what it took.
    true_p, true_d = QuadCoeffs(0.005, 2.7e-5, 4.4e-10), QuadCoeffs(0.0065, 2.0e-5, 5.0e-8)
    profile = replace(DEFAULT_PROFILE, prefill=true_p, decode=true_d)
    rng = random.Random(1)
    model = CostModel(profile)
    for k in range(256):
        batch = rng.randint(1, 64)
        context = batch * rng.randint(100, 2000)
        decode_s = true_d.b * batch + true_d.c * context
        if k % 8:
            n = 512 - batch
            t = max(true_p.a, true_d.a) + true_p.b * n + true_p.c * n * n + decode_s
        else:
            n, t = 0, true_d.a + decode_s
        model.observe(StepSample(t, n, batch, context, end_s=float(k)))
    model.refit()
    plain_s = true_d.a + true_d.b * 32 + true_d.c * 32 * 1000
    assert model.decode_step_s(32, 32 * 1000) == pytest.approx(plain_s, rel=0.1)
    assert model.step_s(0, 32, 32 * 1000) == pytest.approx(plain_s, rel=0.1)
    mixed_s = true_d.a + true_p.b * 480 + true_p.c * 480**2 + plain_s - true_d.a
    assert model.step_s(480, 32, 32 * 1000) == pytest.approx(mixed_s, rel=0.1)


def test_a_young_model_refits_at_every_step_before_its_first_eight() -> None:
    """Seeded with a GPU's profile (0.04 s for 200 tokens), a CPU worker's prefills
    ran 1 s: three steps in, its curve is already near them, not still at the seed."""
    model = CostModel(DEFAULT_PROFILE)
    for i in range(3):
        model.observe(StepSample(1.0, 200, 0, 200, end_s=float(i)))
    assert model.prefill_s(200) > 0.25


ENCODE = EncodeCoeffs(a=0.002, b=8.0e-5)  # InternVL2-26B's encoder (loadgen/profiles)


def _with_images(steps: list[StepSample], seed: int = 1) -> list[StepSample]:
    """``steps`` where every other prefill step also encoded one request's images inside
    it (as vLLM does), its duration grown by that encode."""
    rng = random.Random(seed)
    out = []
    for k, s in enumerate(steps):
        if s.num_prefill_tokens and k % 4 == 0:
            m = 256 * rng.randint(2, 8)
            s = replace(
                s,
                duration_s=s.duration_s + ENCODE.encode_s(m),
                num_encodes=1,
                num_encoded_image_tokens=m,
            )
        out.append(s)
    return out


def test_a_step_that_encoded_images_is_fitted_without_its_encodes() -> None:
    profile = replace(DEFAULT_PROFILE, encode=ENCODE)
    model = CostModel(profile)
    steps = _with_images(synthetic_steps(400))
    assert sum(s.num_encodes for s in steps) > 50
    for s in steps:
        model.observe(s)
    model.refit()
    _close(model.prefill_coeffs, TRUE_PREFILL, rel=0.05)
    # The step as it ran is the work plus its encode.
    s = next(s for s in steps if s.num_encodes)
    work_s = model.step_s(s.num_prefill_tokens, 0, 0)
    assert model.encodes_s(s) == pytest.approx(ENCODE.encode_s(s.num_encoded_image_tokens))
    assert model.sample_s(s) == pytest.approx(work_s + model.encodes_s(s))
    assert model.sample_s(s) == pytest.approx(s.duration_s, rel=0.05)
    # Fitted as prefill, the same steps make an image prompt's prefill look slower by
    # part of its encode, which the policy adds again on top.
    naive = CostModel(profile)
    for s in steps:
        naive.observe(replace(s, num_encodes=0, num_encoded_image_tokens=0))
    naive.refit()
    assert naive.prefill_s(1500) > model.prefill_s(1500) * 1.05


def test_a_step_its_encodes_explain_whole_teaches_nothing() -> None:
    model = CostModel(replace(DEFAULT_PROFILE, encode=ENCODE))
    model.observe(StepSample(0.01, 100, 0, 0, 1.0, num_encodes=1, num_encoded_image_tokens=2048))
    assert model.num_samples == 0
