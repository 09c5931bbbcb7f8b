"""FakeEngine and FakeTokenizer: the in-memory fakes beside the Engine protocol.

The fake implements the whole protocol (prefill-only, adopt, start_adopted,
release_held) with a real paged KV pool tensor, so everything above the engine
(workers, connectors, the gateway) can be tested without a model.

Its "model" is a hash: each step writes every new token's id into its KV slot
(K plane) and samples the next token from the context *read back from the KV
pool*. So an adopted request whose KV pull delivered the wrong bytes produces
different text: disaggregated-equals-colocated checks stay meaningful.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtransfer.types import KVLayout
from services.engine.messages import (
    EngineRequest,
    EngineStats,
    FinishReason,
    HeldKV,
    InvalidRequestError,
    NoRoomError,
    RequestOutput,
    RunningRequestStats,
    StepStats,
    TokenLogprob,
)
from services.engine.validation import validate_request

__all__ = ["FakeEngine", "FakeModelInfo", "FakeTokenizer", "make_fake_engine"]

_EOS = 0
_VOCAB = 256


class FakeTokenizer:
    """One token per Latin-1 character; id 0 is EOS; no BOS."""

    vocab_size = _VOCAB
    eos_token_ids = (_EOS,)
    bos_token_id = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) if 0 < ord(c) < _VOCAB else ord("?") for c in text]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(t) for t in token_ids if t != _EOS)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        text = "".join(f"<{m['role']}>{m.get('content') or ''}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


@dataclass(slots=True)
class FakeModelInfo:
    name: str = "fake"
    max_model_len: int = 512
    vocab_size: int = _VOCAB
    eos_token_ids: tuple[int, ...] = (_EOS,)


@dataclass(slots=True)
class _Seq:
    request: EngineRequest
    tokens: list[int]  # prompt + outputs
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    rng: random.Random = field(default_factory=random.Random)

    @property
    def num_prompt(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.num_prompt :]


class FakeEngine:
    """A deterministic Engine with a real block pool. Not thread-safe (like every engine)."""

    def __init__(
        self,
        *,
        num_blocks: int = 256,
        block_size: int = 16,
        max_model_len: int = 512,
        max_num_seqs: int = 64,
        name: str = "fake",
        step_s: float = 0.0,
    ) -> None:
        """``step_s``: wall time each ``step`` takes, standing in for a model's forward pass
        (0: steps take microseconds, so requests arriving a few ms apart never share one)."""
        self._step_s = step_s
        self._info = FakeModelInfo(name=name, max_model_len=max_model_len)
        self._layout = KVLayout(
            num_layers=1, block_size=block_size, num_kv_heads=1, head_dim=1, dtype="float32"
        )
        self._kv = torch.zeros((num_blocks, *self._layout.block_shape), dtype=torch.float32)
        self._tokenizer = FakeTokenizer()
        self._max_num_seqs = max_num_seqs
        self._free: list[int] = list(range(num_blocks))
        self._waiting: list[_Seq] = []
        self._running: list[_Seq] = []
        self._adopting: dict[str, _Seq] = {}
        self._held: dict[str, list[int]] = {}
        self._recent_steps: list[StepStats] = []
        self._recent_output_lens: list[int] = []
        self._num_prompt_tokens_computed = 0

    # -- protocol: properties ------------------------------------------------
    @property
    def model_info(self) -> FakeModelInfo:
        return self._info

    @property
    def kv_layout(self) -> KVLayout:
        return self._layout

    @property
    def kv_storage(self) -> torch.Tensor:
        return self._kv

    # -- protocol: requests ----------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        self._validate(request)
        self._waiting.append(self._new_seq(request))

    def step(self) -> list[RequestOutput]:
        if self._step_s > 0:
            time.sleep(self._step_s)
        self._admit()
        outputs: list[RequestOutput] = []
        num_prefill = 0
        for seq in list(self._running):
            if not self._ensure_blocks(seq, len(seq.tokens)):
                continue  # no room this step; it stays running and tries again
            num_prefill += max(0, seq.num_prompt - seq.num_computed)
            self._write_kv(seq)
            outputs.append(self._sample_and_check(seq))
        self._num_prompt_tokens_computed += num_prefill
        self._remember_step(num_prefill, len(outputs))
        return outputs

    def abort(self, request_id: str) -> None:
        for queue in (self._waiting, self._running):
            for seq in queue:
                if seq.request.request_id == request_id:
                    queue.remove(seq)
                    self._free.extend(seq.block_ids)
                    return
        if request_id in self._adopting:
            self._free.extend(self._adopting.pop(request_id).block_ids)
        self.release_held(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def stats(self) -> EngineStats:
        return EngineStats(
            block_size=self._layout.block_size,
            num_total_blocks=self._kv.shape[0],
            num_free_blocks=len(self._free),
            num_cached_blocks=0,
            num_held_blocks=sum(len(b) for b in self._held.values()),
            running=tuple(
                RunningRequestStats(
                    s.request.request_id,
                    len(s.tokens),
                    len(s.output_ids),
                    s.request.sampling.max_tokens,
                )
                for s in self._running
            ),
            waiting_prompt_lens=tuple(s.num_prompt for s in self._waiting),
            waiting_request_ids=tuple(s.request.request_id for s in self._waiting),
            recent_steps=tuple(self._recent_steps),
            recent_output_lens=tuple(self._recent_output_lens),
            num_preemptions=0,
            num_prefix_hit_tokens=0,
            num_prompt_tokens_computed=self._num_prompt_tokens_computed,
        )

    # -- protocol: disaggregation ---------------------------------------------
    def release_held(self, request_id: str) -> None:
        self._free.extend(self._held.pop(request_id, []))

    def adopt(self, request: EngineRequest) -> list[int]:
        self._validate(request)
        if not request.output_token_ids:
            raise InvalidRequestError("an adopted request needs its first token", "request")
        seq = self._new_seq(request)
        if not self._ensure_blocks(seq, seq.num_prompt):
            raise NoRoomError("no free KV blocks to adopt the request")
        self._adopting[request.request_id] = seq
        return list(seq.block_ids)

    def start_adopted(self, request_id: str) -> None:
        seq = self._adopting.pop(request_id)
        seq.num_computed = seq.num_prompt
        self._running.append(seq)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(token_ids)

    # -- the fake model ----------------------------------------------------------
    def _validate(self, request: EngineRequest) -> None:
        """The embedded engine's checks (``validate_request``): a fake refuses what the
        engine it stands in for refuses."""
        validate_request(request, self._info.vocab_size, self._info.max_model_len)

    def _new_seq(self, request: EngineRequest) -> _Seq:
        seed = request.sampling.seed if request.sampling.seed is not None else 0
        return _Seq(
            request,
            [*request.prompt_token_ids, *request.output_token_ids],
            rng=random.Random(seed),
        )

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self._max_num_seqs:
            seq = self._waiting[0]
            if not self._ensure_blocks(seq, len(seq.tokens)):
                return
            self._running.append(self._waiting.pop(0))

    def _ensure_blocks(self, seq: _Seq, num_tokens: int) -> bool:
        needed = math.ceil(num_tokens / self._layout.block_size) - len(seq.block_ids)
        if needed > len(self._free):
            return False
        for _ in range(max(0, needed)):
            seq.block_ids.append(self._free.pop())
        return True

    def _slot(self, seq: _Seq, position: int) -> tuple[int, int]:
        bs = self._layout.block_size
        return seq.block_ids[position // bs], position % bs

    def _write_kv(self, seq: _Seq) -> None:
        for pos in range(seq.num_computed, len(seq.tokens)):
            block, offset = self._slot(seq, pos)
            self._kv[block, 0, 0, 0, offset, 0] = float(seq.tokens[pos])
            self._kv[block, 0, 1, 0, offset, 0] = float(pos)
        seq.num_computed = len(seq.tokens)

    def _next_token(self, seq: _Seq) -> int:
        # Read the context back from the KV pool (K plane), not from seq.tokens.
        keys = self._kv[seq.block_ids, 0, 0, 0, :, 0].reshape(-1)[: len(seq.tokens)]
        context = [int(k) for k in keys.tolist()]
        h = sum((i + 1) * t * 31 for i, t in enumerate(context)) + 7 * len(context)
        if seq.request.sampling.temperature > 0:
            h += seq.rng.randrange(1 << 16)
        eos_allowed = not seq.request.sampling.ignore_eos and len(seq.output_ids) >= max(
            seq.request.sampling.min_tokens, 1
        )
        if eos_allowed and h % 61 == 0:
            return _EOS
        return ord("a") + h % 26 if h % 5 else ord(" ")

    def _sample_and_check(self, seq: _Seq) -> RequestOutput:
        # Token ids only, as the real engines: stop strings are the gateway's.
        sampling = seq.request.sampling
        token = self._next_token(seq)
        seq.tokens.append(token)
        finish: FinishReason | None = None
        if token in (_EOS, *sampling.stop_token_ids) and not sampling.ignore_eos:
            finish = FinishReason.STOP
        elif len(seq.output_ids) >= sampling.max_tokens or len(seq.tokens) >= (
            self._info.max_model_len
        ):
            finish = FinishReason.LENGTH
        held: HeldKV | None = None
        if finish is None and seq.request.prefill_only:
            finish = FinishReason.PREFILLED
            held = self._hold_prompt(seq)
        if finish is not None:
            self._finish(seq, keep_blocks=held is not None)
        return RequestOutput(
            request_id=seq.request.request_id,
            new_token_ids=(token,),
            finish_reason=finish,
            logprobs=self._logprobs(token, sampling.logprobs),
            prompt_logprobs=self._prompt_logprobs(seq),
            num_prompt_tokens=seq.num_prompt,
            num_output_tokens=len(seq.output_ids),
            held_kv=held,
        )

    def _hold_prompt(self, seq: _Seq) -> HeldKV:
        num_blocks = math.ceil(seq.num_prompt / self._layout.block_size)
        held, extra = seq.block_ids[:num_blocks], seq.block_ids[num_blocks:]
        self._free.extend(extra)
        seq.block_ids = held
        self._held[seq.request.request_id] = held
        return HeldKV(tuple(held), seq.num_prompt, self._layout)

    def _finish(self, seq: _Seq, *, keep_blocks: bool) -> None:
        self._running.remove(seq)
        if not keep_blocks:
            self._free.extend(seq.block_ids)
        self._recent_output_lens = [*self._recent_output_lens[-63:], len(seq.output_ids)]

    @staticmethod
    def _logprobs(token: int, k: int | None) -> tuple[TokenLogprob, ...] | None:
        if k is None:
            return None
        return (TokenLogprob(token, -0.5, FakeEngine._top(token, k)),)

    @staticmethod
    def _top(token: int, k: int) -> tuple[tuple[int, float], ...]:
        return tuple((token if i == 0 else ord("a") + i, -0.5 - i) for i in range(k))

    @classmethod
    def _prompt_logprobs(cls, seq: _Seq) -> tuple[TokenLogprob, ...] | None:
        """With the first token of a request that computed its prompt here: prompt
        token ``i`` at ``-i / 100``, the likeliest, then its alternatives."""
        request = seq.request
        k = request.sampling.prompt_logprobs
        if k is None or request.output_token_ids or len(seq.output_ids) != 1:
            return None
        return tuple(
            TokenLogprob(t, -i / 100, ((t, -i / 100), *cls._top(t, k)[1:]) if k else ())
            for i, t in enumerate(request.prompt_token_ids[1:], start=1)
        )

    def _remember_step(self, num_prefill: int, num_seqs: int) -> None:
        if num_seqs == 0:
            return
        context = sum(len(s.tokens) for s in self._running)
        step = StepStats(1e-4 * num_seqs, num_prefill, num_seqs, context, time.monotonic())
        self._recent_steps = [*self._recent_steps[-15:], step]


def make_fake_engine(model_cfg: Any, engine_cfg: Any, admission: Any = None) -> FakeEngine:
    """Registered as backend ``fake``: a FakeEngine sized like ``engine_cfg`` (tests only)."""
    del model_cfg, admission
    layout_bytes = 2 * engine_cfg.block_size * 4  # one layer, K and V planes, float32
    return FakeEngine(
        num_blocks=max(1, engine_cfg.kv_cache_bytes // layout_bytes),
        block_size=engine_cfg.block_size,
        max_model_len=engine_cfg.max_model_len or 512,
        max_num_seqs=engine_cfg.max_num_seqs,
    )
