from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from loadgen.arrivals import RateSpec, arrival_times, parse_rate
from loadgen.scenario import WorkloadConfig, build_requests, synthetic_prompt
from loadgen.trace import load_mooncake, load_sharegpt
from loadgen.workload import Fixed, LogNormal, Mixture, Uniform, WorkloadError, parse_length


def test_parse_each_kind() -> None:
    assert parse_length("256") == Fixed(256)
    assert parse_length("fixed:7") == Fixed(7)
    assert parse_length("uniform:32-256") == Uniform(32, 256)
    assert parse_length("lognormal:mean=300,sigma=1.0") == LogNormal(300.0, 1.0)
    mix = parse_length("mix:0.9*uniform:32-256,0.1*uniform:2000-6000")
    assert isinstance(mix, Mixture)
    assert mix.weights == pytest.approx((0.9, 0.1))
    assert mix.parts == (Uniform(32, 256), Uniform(2000, 6000))
    # A mix part may itself contain commas.
    mix2 = parse_length("mix:1*lognormal:mean=100,sigma=0.5,3*fixed:10")
    assert isinstance(mix2, Mixture) and mix2.parts == (LogNormal(100, 0.5), Fixed(10))
    assert mix2.mean == pytest.approx(0.25 * 100 + 0.75 * 10)


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("", "empty"),
        ("gauss:1", "unknown kind 'gauss'"),
        ("uniform:30", "LOW-HIGH"),
        ("uniform:300-30", "LOW <= HIGH"),
        ("lognormal:mean=300", "missing sigma"),
        ("normal:mean=x,std=1", "'x' is not a number"),
        ("mix:uniform:1-2", "WEIGHT*SPEC"),
        ("0", ">= 1"),
    ],
)
def test_parse_errors_name_the_problem(spec: str, needle: str) -> None:
    with pytest.raises(WorkloadError, match=None) as exc:
        parse_length(spec)
    assert needle in str(exc.value)


def test_samples_follow_the_distribution_and_are_seeded() -> None:
    dist = parse_length("mix:0.9*uniform:32-256,0.1*uniform:2000-6000")
    a = dist.sample(np.random.default_rng(1), 20_000)
    b = dist.sample(np.random.default_rng(1), 20_000)
    assert np.array_equal(a, b)
    long_share = float(np.mean(a >= 2000))
    assert 0.085 < long_share < 0.115
    assert a.min() >= 32 and a.max() <= 6000
    ln = parse_length("lognormal:mean=300,sigma=1.0").sample(np.random.default_rng(2), 200_000)
    assert ln.mean() == pytest.approx(300, rel=0.03)  # mean is the arithmetic mean
    assert ln.min() >= 1


def test_gamma_arrivals_mean_rate_and_burstiness() -> None:
    rng = np.random.default_rng(0)
    poisson = np.diff(arrival_times(RateSpec(10.0), 50_000, 1.0, rng))
    bursty = np.diff(arrival_times(RateSpec(10.0), 50_000, 0.25, rng))
    assert poisson.mean() == pytest.approx(0.1, rel=0.03)
    assert bursty.mean() == pytest.approx(0.1, rel=0.05)
    # Coefficient of variation of gamma(k) gaps is 1/sqrt(k).
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.08)


def test_a_run_of_set_duration_fills_its_span_with_poisson_arrivals() -> None:
    """With ``duration_s`` the requests that fit are spread over exactly that time: drawn
    one gap after another, 20 requests at 1 req/s (seed 1) spanned 29 s of a 20 s run,
    and a goodput counted over the run's 20 s saw 11 of them."""
    cfg = WorkloadConfig(input_len="8", output_len="8", duration_s=20.0, seed=1)
    spans = []
    for seed in range(200):
        times = np.array(
            [r.arrival_s for r in build_requests(replace(cfg, seed=seed), RateSpec(1.0))]
        )
        assert len(times) == 20 and times[0] == 0.0 and (np.diff(times) >= 0).all()
        assert times[-1] < 20.0  # none spills past the run
        spans.append(times[1:])
    # Conditioned on its count, a Poisson process's arrivals are uniform over the span.
    points = np.concatenate(spans) / 20.0
    assert points.mean() == pytest.approx(0.5, abs=0.02)
    assert np.histogram(points, bins=4, range=(0, 1))[0] / len(points) == pytest.approx(
        [0.25] * 4, abs=0.03
    )
    # Bursts stay bursts: the gaps' spread is a gamma's, not a clock's.
    gaps = np.diff(arrival_times(RateSpec(10.0), 5000, 0.25, np.random.default_rng(0), 500.0))
    assert gaps.mean() == pytest.approx(0.1, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(2.0, rel=0.1)
    with pytest.raises(WorkloadError):
        arrival_times(RateSpec(1.0), 5, 1.0, np.random.default_rng(0), 0.0)


def test_ramp_speeds_up() -> None:
    t = arrival_times(parse_rate("ramp:1-20"), 2000, 1.0, np.random.default_rng(0))
    first, last = np.diff(t[:200]).mean(), np.diff(t[-200:]).mean()
    assert first > 5 * last
    assert parse_rate("inf").label == "inf"
    with pytest.raises(WorkloadError):
        parse_rate("-3")


def test_conversations_share_a_growing_prefix() -> None:
    cfg = WorkloadConfig(input_len="40", output_len="20", num_requests=6, turns=3, block_size=16)
    reqs = build_requests(cfg, RateSpec(1.0))
    session = sorted((r for r in reqs if r.session_id == 0), key=lambda r: r.turn)
    assert [r.input_len for r in session] == [40, 100, 160]  # 40, +20 out +40 in, ...
    assert session[1].hash_ids[: len(session[0].hash_ids)] == session[0].hash_ids
    p0, p1 = synthetic_prompt(session[0]), synthetic_prompt(session[1])
    assert len(p0) == 40 and len(p1) == 100
    shared = len(session[0].hash_ids) * 16
    assert p1[:shared] == p0[:shared]
    other = next(r for r in reqs if r.session_id == 1 and r.turn == 0)
    assert synthetic_prompt(other)[:32] != p0[:32]


def test_build_is_reproducible() -> None:
    cfg = WorkloadConfig(
        input_len="uniform:10-100", output_len="lognormal:mean=50,sigma=0.5", seed=3
    )
    assert build_requests(cfg, RateSpec(5.0)) == build_requests(cfg, RateSpec(5.0))
    other = build_requests(WorkloadConfig(seed=4, input_len="uniform:10-100"), RateSpec(5.0))
    assert other != build_requests(cfg, RateSpec(5.0))


def test_mooncake_trace(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 1500, "input_length": 1000, "output_length": 10, "hash_ids": [1, 2]},
        {"timestamp": 500, "input_length": 600, "output_length": 0, "hash_ids": [1]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    specs = load_mooncake(path)
    assert [s.arrival_s for s in specs] == [0.0, 1.0]  # sorted, shifted, ms -> s
    assert specs[0].input_len == 600 and specs[0].output_len == 1
    assert specs[1].hash_ids == (1, 2) and specs[1].hash_block_size == 512
    path.write_text('{"timestamp": 1}\n')
    with pytest.raises(WorkloadError, match=r"t\.jsonl:1"):
        load_mooncake(path)


def test_sharegpt(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    conv = [
        {"from": "human", "value": "hello"},
        {"from": "gpt", "value": "hi there"},
        {"from": "human", "value": "more"},
        {"from": "gpt", "value": "ok"},
    ]
    path.write_text(json.dumps([{"id": "a", "conversations": conv}]))
    specs = load_sharegpt(path)
    assert [(s.input_len, s.output_len) for s in specs] == [(5, 8), (5 + 1 + 8 + 1 + 4, 2)]
    assert specs[1].prompt == "hello\nhi there\nmore"


class FakeTokenizer:
    """Decodes each id to one space-separated word; vocab of 5000."""

    vocab_size = 5000

    def decode(self, token_ids: list[int]) -> str:
        return " ".join(f"w{i}" for i in token_ids)


def test_prompt_in_target_tokens_with_shared_prefix() -> None:
    cfg = WorkloadConfig(input_len="40", output_len="5", num_requests=4, turns=2, block_size=16)
    reqs = build_requests(cfg, RateSpec(1.0))
    first, second = sorted((r for r in reqs if r.session_id == 0), key=lambda r: r.turn)
    words0 = synthetic_prompt(first, FakeTokenizer()).split()
    words1 = synthetic_prompt(second, FakeTokenizer()).split()
    assert len(words0) == 40 and len(words1) == second.input_len
    assert words1[:32] == words0[:32]  # two shared blocks of 16 tokens
    assert all(1000 <= int(w[1:]) < 5000 for w in words0)  # special ids avoided


def test_prompt_in_target_tokens_never_holds_a_special_token() -> None:
    """A multimodal model's image placeholder sits in the vocabulary like any word: drawn
    into a synthetic prompt, the gateway refuses the request (placeholders and images
    disagree). With a real Hugging Face tokenizer whose specials are at the top."""
    from tests.unit.engine.conftest import word_tokenizer

    words = [f"w{i}" for i in range(46)] + ["<s>", "</s>", "<image>", "<pad>"]
    specials = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    tokenizer = word_tokenizer(words, **specials, extra_special_tokens={"image_token": "<image>"})
    assert set(tokenizer.all_special_ids) == {46, 47, 48, 49}
    cfg = WorkloadConfig(input_len="400", output_len="5", num_requests=8)
    for spec in build_requests(cfg, RateSpec(1.0)):
        ids = tokenizer(synthetic_prompt(spec, tokenizer), add_special_tokens=False).input_ids
        assert len(ids) == 400  # one word per id: as many tokens as asked
        assert max(ids) <= 45  # specials drawn (4 of 38 ids from 12) became ordinary ids
        assert min(ids) >= 12
