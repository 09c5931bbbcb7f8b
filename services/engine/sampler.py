"""Turn a step's logits into one token per sequence.

Per row, in order: logprobs of the raw logits (reported, vLLM's default), then
``min_tokens`` masking of EOS/stop ids, presence/frequency penalties over the
output so far (OpenAI semantics), ``logit_bias`` added, then either argmax (temperature 0) or
temperature, top-k, top-p, min-p and a draw.

Seeded draws are reproducible anywhere: the noise for a request's output token
``i`` comes from a CPU generator seeded with ``token_seed(seed, i)``, so the same
token comes out alone or in any batch, on any worker that continues the request.
Draws use the exponential race (argmax of p / E with E ~ Exp(1)), which picks
token t with probability p_t.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from services.engine.messages import SamplingParams, TokenLogprob

__all__ = ["SampleResult", "Sampler", "token_seed"]

_GREEDY_EPS = 1e-5
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # None where the request asked for none


def token_seed(seed: int, output_index: int) -> int:
    """A well-mixed 63-bit seed for output token ``output_index`` of a request seeded ``seed``."""
    z = (seed * 0x9E3779B97F4A7C15 + output_index * 0xBF58476D1CE4E5B9 + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64  # splitmix64 finaliser
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class Sampler:
    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        output_token_ids: Sequence[Sequence[int]],
        eos_token_ids: Sequence[tuple[int, ...]] | tuple[int, ...],
        global_generator: torch.Generator,
        prompt_ids: Sequence[torch.Tensor],
    ) -> SampleResult:
        """``logits`` [N, vocab] float32; ``eos_token_ids`` per row or one tuple for all
        rows; ``prompt_ids``: each row's distinct prompt token ids (int64, on the CPU; any,
        even empty, where ``repetition_penalty`` is 1), which the penalty counts as seen."""
        if _all_plain_greedy(params, output_token_ids):
            # The common serving case: one argmax, no copy of the logits, no per-row work.
            return SampleResult(_argmax_rows(logits), [None] * len(params))
        logits = logits.float()
        raw_logprobs = (
            torch.log_softmax(logits, dim=-1)
            if any(p.logprobs is not None for p in params)
            else None
        )
        eos = _per_row_eos(eos_token_ids, len(params))
        logits = logits.clone()
        _mask_until_min_tokens(logits, params, output_token_ids, eos)
        # vLLM's order: the bias, then the penalties (the repetition penalty scales what
        # the bias moved).
        _apply_logit_bias(logits, params)
        _apply_repetition_penalty(logits, params, output_token_ids, prompt_ids)
        _apply_penalties(logits, params, output_token_ids)
        token_ids = _choose(logits, params, output_token_ids, global_generator)
        logprobs = [
            None
            if raw_logprobs is None or p.logprobs is None
            else _logprob(raw_logprobs[i], t, p.logprobs)
            for i, (p, t) in enumerate(zip(params, token_ids))
        ]
        return SampleResult(token_ids=token_ids, logprobs=logprobs)


def _argmax_rows(logits: torch.Tensor) -> list[int]:
    if logits.device.type == "cpu":
        # numpy's argmax is vectorised; torch's takes ~850 us for [32, 32000] on one core.
        # Both return the first maximum (and the first NaN, should one appear).
        return np.argmax(logits.detach().float().numpy(), axis=-1).tolist()  # type: ignore[no-any-return]
    return logits.argmax(dim=-1).tolist()  # type: ignore[no-any-return]


def _all_plain_greedy(
    params: Sequence[SamplingParams], output_token_ids: Sequence[Sequence[int]]
) -> bool:
    """Every row takes its argmax: no draw, no logprobs, penalties or min_tokens masking."""
    return all(
        p.temperature < _GREEDY_EPS
        and p.logprobs is None
        and p.presence_penalty == 0
        and p.frequency_penalty == 0
        and p.repetition_penalty == 1
        and len(out) >= p.min_tokens
        and not p.logit_bias
        for p, out in zip(params, output_token_ids)
    )


def _per_row_eos(
    eos: Sequence[tuple[int, ...]] | tuple[int, ...], num_rows: int
) -> list[tuple[int, ...]]:
    if all(isinstance(e, int) for e in eos):
        shared = tuple(int(e) for e in eos)  # type: ignore[arg-type]
        return [shared] * num_rows
    return [tuple(e) for e in eos]  # type: ignore[arg-type]


def _mask_until_min_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]],
    eos: list[tuple[int, ...]],
) -> None:
    for i, p in enumerate(params):
        if len(output_token_ids[i]) >= p.min_tokens:
            continue
        # With ignore_eos, EOS never stops the request, so there is nothing to hold off.
        banned = [*p.stop_token_ids, *(() if p.ignore_eos else eos[i])]
        if banned:
            logits[i, torch.tensor(banned, device=logits.device)] = float("-inf")


def _apply_repetition_penalty(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]],
    prompt_ids: Sequence[torch.Tensor],
) -> None:
    """vLLM's: each token seen in the prompt or the output so far has a positive logit
    divided by the penalty and a negative one multiplied by it."""
    for i, p in enumerate(params):
        if p.repetition_penalty == 1:
            continue
        outputs = torch.tensor(list(output_token_ids[i]), dtype=torch.int64)
        ids = torch.cat((prompt_ids[i], outputs)).unique().to(logits.device)
        row = logits[i, ids]
        logits[i, ids] = torch.where(
            row > 0, row / p.repetition_penalty, row * p.repetition_penalty
        )


def _apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]],
) -> None:
    vocab = logits.shape[1]
    for i, p in enumerate(params):
        if (p.presence_penalty == 0 and p.frequency_penalty == 0) or not output_token_ids[i]:
            continue
        ids = torch.tensor(list(output_token_ids[i]), dtype=torch.int64, device=logits.device)
        counts = torch.bincount(ids, minlength=vocab)[:vocab].float()
        logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()


def _apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    for i, p in enumerate(params):
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], device=logits.device)
            bias = torch.tensor([b for _, b in p.logit_bias], device=logits.device)
            logits[i].index_add_(0, ids, bias.to(logits.dtype))


def _choose(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]],
    global_generator: torch.Generator,
) -> list[int]:
    chosen = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if p.temperature >= _GREEDY_EPS]
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        probs = _filtered_probs(logits[rows], [params[i] for i in random_rows])
        noise = torch.empty_like(probs)
        unseeded = []
        for j, i in enumerate(random_rows):
            seed = params[i].seed
            if seed is None:
                unseeded.append(j)
                continue
            g = torch.Generator(device="cpu").manual_seed(
                token_seed(seed, len(output_token_ids[i]))
            )
            noise[j] = torch.empty(probs.shape[1]).exponential_(generator=g).to(probs.device)
        if unseeded:
            shape = (len(unseeded), probs.shape[1])
            draw = torch.empty(shape, device=global_generator.device)
            noise[unseeded] = draw.exponential_(generator=global_generator).to(probs.device)
        # A zero draw would turn a masked token's 0/0 into NaN; the floor changes nothing else.
        chosen[rows] = (probs / noise.clamp_min_(1e-20)).argmax(dim=-1)
    return [int(t) for t in chosen.tolist()]


def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p; masked tokens get probability 0."""
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], device=device)
    logits = logits / temps[:, None]
    vocab = logits.shape[1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    if bool((top_k < vocab).any()) or bool((top_p < 1.0).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=device)[None, :]
        sorted_logits = sorted_logits.masked_fill(rank >= top_k[:, None], float("-inf"))
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Keep a token while the mass before it is below top_p (the top token is always kept).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    min_p = torch.tensor([p.min_p for p in params], device=device)
    if bool((min_p > 0).any()):
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def _logprob(row: torch.Tensor, token_id: int, num_top: int) -> TokenLogprob:
    top: tuple[tuple[int, float], ...] = ()
    if num_top > 0:
        values, ids = row.topk(num_top)
        top = tuple((int(t), float(v)) for t, v in zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token_id=token_id, logprob=float(row[token_id]), top=top)
