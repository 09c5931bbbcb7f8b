"""Sampler semantics: greedy, truncation, penalties, min_tokens, seeds and logprobs."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from services.engine.messages import SamplingParams
from services.engine.sampler import Sampler, SampleResult

V = 8
EOS = (7,)


def _sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    outputs: Sequence[Sequence[int]] | None = None,
    generator_seed: int = 0,
) -> SampleResult:
    return Sampler().sample(
        logits,
        params,
        outputs if outputs is not None else [[] for _ in params],
        EOS,
        torch.Generator().manual_seed(generator_seed),
        [torch.empty(0, dtype=torch.int64)] * len(params),
    )


def _random_logits(n: int, seed: int, vocab: int = V) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 2


def _counts(logits_row: torch.Tensor, params: SamplingParams, n: int = 400) -> Counter[int]:
    batch = logits_row.repeat(n, 1)
    return Counter(_sample(batch, [params] * n, generator_seed=1).token_ids)


def test_greedy_is_argmax() -> None:
    logits = _random_logits(5, seed=0)
    out = _sample(logits, [SamplingParams(temperature=0.0)] * 5)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 5


def test_top_k_restricts_support_to_the_k_best() -> None:
    row = torch.tensor([0.0, 3.0, 1.0, 2.9, -1.0, 2.8, 0.5, 0.1])
    counts = _counts(row, SamplingParams(temperature=1.5, top_k=3))
    assert set(counts) == {1, 3, 5}


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([0.05, 0.4, 0.05, 0.3, 0.05, 0.1, 0.03, 0.02])
    # sorted: 0.4, 0.3, 0.1, ... ; 0.4 + 0.3 = 0.7 < 0.75, so the 0.1 token joins.
    counts = _counts(probs.log(), SamplingParams(temperature=1.0, top_p=0.75))
    assert set(counts) == {1, 3, 5}
    assert counts[1] > counts[3] > counts[5]


def test_min_p_drops_tokens_below_a_fraction_of_the_best() -> None:
    probs = torch.tensor([0.3, 0.2, 0.14, 0.16, 0.1, 0.05, 0.03, 0.02])
    counts = _counts(probs.log(), SamplingParams(temperature=1.0, min_p=0.5))
    assert set(counts) == {0, 1, 3}


def test_temperature_sharpens_and_flattens() -> None:
    row = torch.tensor([2.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    cold = _counts(row, SamplingParams(temperature=0.2))
    hot = _counts(row, SamplingParams(temperature=2.0))
    assert cold[0] > 380  # p(0) = 0.993 at T=0.2
    assert 75 < hot[0] < 135 and len(hot) == V  # p(0) = 0.26 at T=2


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.25, 0.125, 0.125, 0.0, 0.0, 0.0, 0.0])
    counts = _counts((probs + 1e-30).log(), SamplingParams(temperature=1.0), n=4000)
    for t, p in enumerate(probs.tolist()):
        assert abs(counts[t] / 4000 - p) < 0.03


def test_presence_and_frequency_penalties_as_computed_by_hand() -> None:
    row = torch.tensor([[5.0, 4.5, 4.2, 0.0, 0.0, 0.0, 0.0, 0.0]])
    outputs = [[0, 0, 0, 1]]  # token 0 three times, token 1 once
    assert _sample(row, [SamplingParams(temperature=0.0)], outputs).token_ids == [0]
    # frequency: 5 - 3*0.5 = 3.5, 4.5 - 0.5 = 4.0, 4.2 -> token 2 wins
    freq = SamplingParams(temperature=0.0, frequency_penalty=0.5)
    assert _sample(row, [freq], outputs).token_ids == [2]
    # presence: 5 - 0.6 = 4.4, 4.5 - 0.6 = 3.9, 4.2 -> token 0 still wins
    pres = SamplingParams(temperature=0.0, presence_penalty=0.6)
    assert _sample(row, [pres], outputs).token_ids == [0]
    # presence 1.0: 4.0, 3.5, 4.2 -> token 2
    pres = SamplingParams(temperature=0.0, presence_penalty=1.0)
    assert _sample(row, [pres], outputs).token_ids == [2]
    # a negative penalty rewards repetition: 4.5 + 1 = 5.5 beats 5 + 3 * ... no: 5 + 1 = 6
    neg = SamplingParams(temperature=0.0, presence_penalty=-1.0)
    assert _sample(row, [neg], [[1]]).token_ids == [1]


def test_min_tokens_blocks_eos_and_stop_ids_until_reached() -> None:
    row = torch.tensor([[0.0, 0.0, 0.0, 9.0, 0.0, 0.0, 1.0, 10.0]])  # EOS (7) best, then 3
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(3,))
    assert _sample(row, [p], [[1]]).token_ids == [6]
    assert _sample(row, [p], [[1, 2]]).token_ids == [7]
    ignore = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True, stop_token_ids=(3,))
    assert _sample(row, [ignore], [[1]]).token_ids == [7]  # EOS does not stop it anyway
    per_row = Sampler().sample(
        row.repeat(2, 1),
        [SamplingParams(temperature=0.0, min_tokens=1)] * 2,
        [[], []],
        [(7,), (3,)],
        torch.Generator(),
        [torch.empty(0, dtype=torch.int64)] * 2,
    )
    assert per_row.token_ids == [3, 7]


def test_seeded_sampling_is_independent_of_batch_and_position() -> None:
    vocab = 50
    logits = _random_logits(1, seed=3, vocab=vocab)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    history = [5, 6, 7]
    alone = _sample(logits, [seeded], [history], generator_seed=0).token_ids[0]
    others = _random_logits(4, seed=4, vocab=vocab)
    batch = torch.cat([others[:2], logits, others[2:]])
    params = [
        SamplingParams(temperature=1.0),
        seeded,  # same seed, another output index
        seeded,  # the row under test
        SamplingParams(seed=9),
        SamplingParams(temperature=0.7, top_k=5),
    ]
    mixed = _sample(batch, params, [[1], [2], history, [], [9]], generator_seed=99)
    assert mixed.token_ids[2] == alone
    # Over many output indices, the draw depends on the index (not a constant)
    # and is reproduced exactly by a fresh sampler.
    flat = torch.zeros(1, vocab)
    draws = [_sample(flat, [seeded], [[0] * i]).token_ids[0] for i in range(30)]
    again = [_sample(flat, [seeded], [[0] * i], generator_seed=5).token_ids[0] for i in range(30)]
    assert draws == again and len(set(draws)) > 10
    other_seed = SamplingParams(temperature=1.0, seed=1235)
    assert [_sample(flat, [other_seed], [[0] * i]).token_ids[0] for i in range(30)] != draws


def test_unseeded_sampling_uses_the_global_generator() -> None:
    logits = torch.zeros(16, 100)
    params = [SamplingParams(temperature=1.0)] * 16
    a = _sample(logits, params, generator_seed=1).token_ids
    assert a == _sample(logits, params, generator_seed=1).token_ids
    assert a != _sample(logits, params, generator_seed=2).token_ids


def test_logprobs_are_raw_log_softmax_with_ordered_top() -> None:
    logits = _random_logits(2, seed=5)
    params = [
        SamplingParams(temperature=0.0, logprobs=3, frequency_penalty=2.0),
        SamplingParams(temperature=0.0, logprobs=0),
    ]
    out = _sample(logits, params, [[int(logits[0].argmax())], []])
    expected = torch.log_softmax(logits, dim=-1)
    first = out.logprobs[0]
    assert first is not None
    # The penalty moved the choice, but the reported logprob is the raw model's.
    assert first.token_id == out.token_ids[0] != int(logits[0].argmax())
    assert abs(first.logprob - float(expected[0, first.token_id])) < 1e-6
    top_ids = expected[0].argsort(descending=True)[:3].tolist()
    assert [t for t, _ in first.top] == top_ids
    assert all(abs(lp - float(expected[0, t])) < 1e-6 for t, lp in first.top)
    second = out.logprobs[1]
    assert second is not None and second.top == ()
    assert abs(second.logprob - float(expected[1].max())) < 1e-6


def test_a_plain_greedy_batch_still_serves_a_row_that_needs_masking_or_logprobs() -> None:
    # The all-greedy shortcut must not swallow one row's min_tokens mask or logprobs.
    row = torch.tensor([[0.0, 0.0, 0.0, 9.0, 0.0, 0.0, 1.0, 10.0]])  # EOS (7) best, then 3
    plain = SamplingParams(temperature=0.0)
    held = SamplingParams(temperature=0.0, min_tokens=2)
    out = _sample(row.repeat(3, 1), [plain, held, plain], [[], [1], []])
    assert out.token_ids == [7, 3, 7]
    with_lp = _sample(row.repeat(2, 1), [plain, SamplingParams(temperature=0.0, logprobs=0)])
    assert with_lp.logprobs[0] is None
    lp = with_lp.logprobs[1]
    assert lp is not None and lp.token_id == 7
    assert abs(lp.logprob - torch.log_softmax(row[0], -1)[7].item()) < 1e-6


def test_the_bias_comes_before_the_repetition_penalty_as_in_vllm() -> None:
    """Token 0 (seen) at 2.0 with a bias of +2 and a penalty of 2: (2 + 2) / 2 = 2.0,
    below token 1's 2.9 (vLLM's order); penalised first it would read 2 / 2 + 2 = 3.0."""
    row = torch.tensor([[2.0, 2.9, 0.0, 0.0]])
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0, logit_bias=((0, 2.0),))
    seen = torch.tensor([0], dtype=torch.int64)
    out = Sampler().sample(row, [p], [[]], EOS, torch.Generator(), [seen])
    assert out.token_ids == [1]
    unseen = Sampler().sample(row, [p], [[]], EOS, torch.Generator(), [seen[:0]])
    assert unseen.token_ids == [0]  # 4.0: the penalty is what moved it
