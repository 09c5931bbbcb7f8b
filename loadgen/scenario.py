"""A workload config -> the list of requests a run sends (shared by bench and simulate).

Synthetic single-turn requests draw input and output lengths from length
specs; ``turns > 1`` makes multi-turn conversations whose prompt is the whole
conversation so far, so later turns share a growing prefix (their ``hash_ids``
repeat the earlier turns' blocks). A workload file replays a trace (keeping its
timestamps unless a rate is given) or a ShareGPT file.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import numpy as np

from loadgen.arrivals import RateSpec, arrival_times
from loadgen.trace import load_workload_file
from loadgen.workload import RequestSpec, WorkloadError, parse_length

__all__ = ["Tokenizer", "WorkloadConfig", "build_requests", "synthetic_prompt"]


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    input_len: str = "256"
    output_len: str = "128"
    num_requests: int = 200
    # With a rate: as many requests as fit in this time, spread over exactly this time
    # (synthetic workloads; ``arrival_times``' span).
    duration_s: float | None = None
    workload_file: Path | None = None
    turns: int = 1
    think_time_s: float = 1.0
    burstiness: float = 1.0
    seed: int = 0
    block_size: int = 16  # tokens per hash id for synthetic prompts
    images_per_request: str = "0"  # a length spec (or 0): images with an image request
    image_size: str = "336"  # a length spec: pixels per side of each (square) image
    image_fraction: float = 1.0  # share of requests that carry images (the rest: text chat)


def build_requests(cfg: WorkloadConfig, rate: RateSpec | None) -> list[RequestSpec]:
    """Requests sorted by arrival. ``rate=None``: closed loop (arrival times unused)."""
    rng = np.random.default_rng(cfg.seed)
    num = _num_requests(cfg, rate)
    if cfg.workload_file is not None:
        specs = load_workload_file(cfg.workload_file)
        if cfg.num_requests and len(specs) > num:
            specs = specs[:num]
        if rate is None:  # trace timestamps (ShareGPT: all at 0, i.e. closed loop)
            return specs
        times = arrival_times(rate, len(specs), cfg.burstiness, rng)
        return [replace(s, arrival_s=float(t)) for s, t in zip(specs, times)]
    if cfg.turns < 1:
        raise WorkloadError(f"turns must be >= 1, got {cfg.turns}")
    if cfg.turns == 1:
        return _single_turn(cfg, rate, num, rng)
    return _conversations(cfg, rate, num, rng)


def _num_requests(cfg: WorkloadConfig, rate: RateSpec | None) -> int:
    if cfg.duration_s is not None and rate is not None:
        return max(1, round(cfg.duration_s * rate.mean_rps))
    if cfg.num_requests < 1:
        raise WorkloadError("num_requests must be >= 1")
    return cfg.num_requests


def _single_turn(
    cfg: WorkloadConfig, rate: RateSpec | None, num: int, rng: np.random.Generator
) -> list[RequestSpec]:
    inputs = parse_length(cfg.input_len).sample(rng, num)
    outputs = parse_length(cfg.output_len).sample(rng, num)
    times = arrival_times(rate, num, cfg.burstiness, rng, cfg.duration_s) if rate else np.zeros(num)
    sides = _image_sides(cfg, num, rng)
    return [
        RequestSpec(
            request_id=f"req-{i}",
            arrival_s=float(times[i]),
            input_len=int(inputs[i]),
            output_len=int(outputs[i]),
            hash_ids=_unique_ids(i, int(inputs[i]), cfg.block_size),
            hash_block_size=cfg.block_size,
            image_sides=sides[i],
        )
        for i in range(num)
    ]


def _image_sides(cfg: WorkloadConfig, num: int, rng: np.random.Generator) -> list[tuple[int, ...]]:
    """Per request, the side of each of its images (none unless images_per_request says so)."""
    if cfg.images_per_request.strip() == "0":
        return [()] * num
    if not 0.0 <= cfg.image_fraction <= 1.0:
        raise WorkloadError(f"image_fraction must be in [0, 1], got {cfg.image_fraction}")
    counts = parse_length(cfg.images_per_request).sample(rng, num)
    with_images = rng.random(num) < cfg.image_fraction
    size = parse_length(cfg.image_size)
    return [
        tuple(int(s) for s in size.sample(rng, int(c))) if carries else ()
        for c, carries in zip(counts, with_images)
    ]


def _unique_ids(owner: int, num_tokens: int, block_size: int) -> tuple[int, ...]:
    # Distinct per request: nothing is shared, so prefix caches never hit.
    return tuple(owner * 1_000_003 + b for b in range(num_tokens // block_size))


def _conversations(
    cfg: WorkloadConfig, rate: RateSpec | None, num: int, rng: np.random.Generator
) -> list[RequestSpec]:
    num_sessions = -(-num // cfg.turns)
    new_inputs = parse_length(cfg.input_len).sample(rng, num_sessions * cfg.turns)
    outputs = parse_length(cfg.output_len).sample(rng, num_sessions * cfg.turns)
    starts = (
        arrival_times(rate, num_sessions, cfg.burstiness, rng, cfg.duration_s)
        if rate
        else np.zeros(num_sessions)
    )
    out: list[RequestSpec] = []
    for s in range(num_sessions):
        context = 0
        for t in range(cfg.turns):
            k = s * cfg.turns + t
            prompt_len = context + int(new_inputs[k])
            out.append(
                RequestSpec(
                    request_id=f"conv-{s}-{t}",
                    arrival_s=float(starts[s]) + t * cfg.think_time_s,
                    input_len=prompt_len,
                    output_len=int(outputs[k]),
                    hash_ids=_unique_ids(s, prompt_len, cfg.block_size),
                    hash_block_size=cfg.block_size,
                    session_id=s,
                    turn=t,
                )
            )
            context = prompt_len + int(outputs[k])
    out.sort(key=lambda r: r.arrival_s)
    return out[:num]


_ALPHABET = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     ", dtype=np.uint8)


class Tokenizer(Protocol):
    """What ``synthetic_prompt`` needs of a Hugging Face tokenizer (which also has
    ``all_special_ids``: read if present)."""

    vocab_size: int

    def decode(self, token_ids: list[int]) -> str: ...


def synthetic_prompt(spec: RequestSpec, tokenizer: Tokenizer | None = None) -> str:
    """Text of about ``input_len`` tokens; blocks named by the same hash id are equal.

    Without a tokenizer: ASCII text of ``input_len`` characters, one token per
    character for the byte-level tiny model, approximate (about a quarter to a
    third as many tokens) for BPE tokenizers. With the target's tokenizer:
    ``input_len`` random token ids decoded to text, which re-encodes to about
    that many tokens (merges at id boundaries can shift it by a few percent), never a
    special one (``all_special_ids``: a multimodal model's image placeholder in the
    text would be refused, its images not matching the placeholders).
    """
    if spec.prompt is not None:
        return spec.prompt
    if tokenizer is not None:
        specials = frozenset(getattr(tokenizer, "all_special_ids", None) or ())
        return tokenizer.decode(_token_ids(spec, tokenizer.vocab_size, specials))
    chunks: list[bytes] = []
    for hash_id in spec.hash_ids:
        block_rng = np.random.default_rng(hash_id & 0xFFFFFFFFFFFF)
        chunks.append(
            _ALPHABET[block_rng.integers(0, len(_ALPHABET), spec.hash_block_size)].tobytes()
        )
    text = b"".join(chunks)[: spec.input_len]
    tail = spec.input_len - len(text)
    if tail > 0:
        tail_rng = np.random.default_rng(zlib.crc32(spec.request_id.encode()))
        text += _ALPHABET[tail_rng.integers(0, len(_ALPHABET), tail)].tobytes()
    return text.decode("ascii")


def _token_ids(spec: RequestSpec, vocab_size: int, specials: frozenset[int]) -> list[int]:
    # Skip the lowest ids, where tokenizers keep special and control tokens, and the
    # special ones elsewhere (drawn, they become the next id down that is not special).
    low, high = min(1000, vocab_size // 4), vocab_size
    if specials:
        return [_ordinary(i, low, specials) for i in _token_ids(spec, vocab_size, frozenset())]
    ids: list[int] = []
    for hash_id in spec.hash_ids:
        block_rng = np.random.default_rng(hash_id & 0xFFFFFFFFFFFF)
        ids.extend(block_rng.integers(low, high, spec.hash_block_size).tolist())
    ids = ids[: spec.input_len]
    if len(ids) < spec.input_len:
        tail_rng = np.random.default_rng(zlib.crc32(spec.request_id.encode()))
        ids.extend(tail_rng.integers(low, high, spec.input_len - len(ids)).tolist())
    return ids


def _ordinary(token_id: int, low: int, specials: frozenset[int]) -> int:
    """``token_id``, or the next id down from it that is not special (up, from ``low``)."""
    while token_id in specials and token_id > low:
        token_id -= 1
    while token_id in specials:
        token_id += 1
    return token_id
