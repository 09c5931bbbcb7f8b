"""Structured outputs with xgrammar: compile once per worker, mask the logits rows, advance.

    GrammarCompiler(tokenizer, vocab_size, eos)   per engine; a bounded cache keyed by
                                                   the constraint's hash
    compiler.matcher(structured, output_ids)       a fresh matcher that has replayed the
                                                   tokens committed so far (a request that
                                                   continues on a decode worker, or after a
                                                   failover, resumes the same state)
    apply_grammar_masks(logits, matchers)          before sampling: rows with a matcher get
                                                   their disallowed tokens set to -inf
    matcher.accept_token(t); is_terminated()       after sampling; terminated stops the request

xgrammar (about 3 s to import) is imported when a compiler is built, at engine start, not
inside a request's compile deadline; where it is not installed the engine still imports
and serves text, and a constrained request gets a 400 saying so.
Compiles run on a helper thread with a deadline, so a pathological schema costs the
engine at most ``compile_timeout_s`` and answers 400 naming the field.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING

import torch

from services.engine.messages import InvalidRequestError, StructuredOutput
from services.engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

if TYPE_CHECKING:
    import xgrammar as xgr

__all__ = ["GrammarCompiler", "apply_grammar_masks", "tokenizer_info"]

_DEFAULT_CACHE_ENTRIES = 256
_DEFAULT_COMPILE_TIMEOUT_S = 0.5


def tokenizer_info(
    tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]
) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary; ``vocab_size`` is the model's (rows of the logits)."""
    import xgrammar as xgr  # imported by GrammarCompiler (the module imports without it)

    if isinstance(tokenizer, HFTokenizer):
        return xgr.TokenizerInfo.from_huggingface(
            tokenizer.hf_tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids)
        )
    if isinstance(tokenizer, ByteTokenizer):
        # Bytes are themselves; special tokens (empty here) never match grammar text.
        vocab = [bytes([i]) for i in range(256)] + [b""] * (vocab_size - 256)
        return xgr.TokenizerInfo(vocab, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids))
    raise InvalidRequestError(
        f"structured outputs need a Hugging Face or byte tokenizer, not {type(tokenizer).__name__}",
        "structured_outputs",
    )


class GrammarCompiler:
    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        *,
        max_entries: int = _DEFAULT_CACHE_ENTRIES,
        compile_timeout_s: float = _DEFAULT_COMPILE_TIMEOUT_S,
    ) -> None:
        try:
            import xgrammar  # noqa: F401  (here, not inside the first compile's deadline)

            self._missing: str | None = None
        except ImportError as e:
            self._missing = str(e)
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = tuple(eos_token_ids)
        self._compiler: xgr.GrammarCompiler | None = None  # built at first use (vocab scan)
        self._cache: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self._max_entries = max_entries
        self._compile_timeout_s = compile_timeout_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        # compile() runs on the worker's prepare thread and on the engine loop (cache hits).
        self._lock = threading.Lock()
        self.num_compiles = 0

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def compile(self, structured: StructuredOutput) -> xgr.CompiledGrammar:
        """The compiled grammar, from the cache when seen before; 400 naming the field if not."""
        key = hashlib.sha256(
            f"{structured.kind}\0{structured.any_whitespace}\0{structured.spec}".encode()
        ).hexdigest()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        if self._missing is not None:
            raise InvalidRequestError(
                f"structured outputs need xgrammar, which does not import here: {self._missing}",
                structured.param,
            )
        structured.validate()
        future = self._pool.submit(self._compile_now, structured)
        try:
            compiled = future.result(timeout=self._compile_timeout_s)
        except FutureTimeout as e:
            raise InvalidRequestError(
                f"the {structured.kind} constraint took over {self._compile_timeout_s} s to compile",
                structured.param,
            ) from e
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's parse errors
            raise InvalidRequestError(
                f"invalid {structured.kind} constraint: {_first_line(e)}", structured.param
            ) from e
        with self._lock:
            self.num_compiles += 1
            self._cache[key] = compiled
            if len(self._cache) > self._max_entries:
                self._cache.popitem(last=False)
        return compiled

    def matcher(
        self, structured: StructuredOutput, output_token_ids: Sequence[int] = ()
    ) -> xgr.GrammarMatcher:
        """A matcher in the state after ``output_token_ids`` (tokens generated elsewhere)."""
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(self.compile(structured))
        for t in output_token_ids:
            if not matcher.accept_token(t):
                raise InvalidRequestError(
                    "the tokens already generated do not follow the constraint",
                    "output_token_ids",
                )
        return matcher

    def _compile_now(self, structured: StructuredOutput) -> xgr.CompiledGrammar:
        import xgrammar as xgr

        if self._compiler is None:
            info = tokenizer_info(self._tokenizer, self._vocab_size, self._eos)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        c = self._compiler
        compact = not structured.any_whitespace
        match structured.kind:
            case "json" | "json_object":
                # json_object: any JSON object, as compact as a schema's output.
                schema = structured.spec if structured.kind == "json" else '{"type": "object"}'
                grammar = xgr.Grammar.from_json_schema(
                    schema,
                    any_whitespace=structured.any_whitespace,
                    separators=(",", ":") if compact else None,
                )
                return c.compile_grammar(_no_raw_control_chars(str(grammar)))
            case "regex":
                return c.compile_regex(structured.spec)
            case "choice":
                return c.compile_grammar(_choice_ebnf(structured.spec))
            case "grammar":
                return c.compile_grammar(structured.spec)
            case "structural_tag":
                return c.compile_structural_tag(structured.spec)
        raise ValueError(f"unknown constraint kind {structured.kind!r}")


# xgrammar 0.2.8 writes strings with ``maxLength``/``minLength`` as this class, which lets
# raw control characters (invalid in JSON) through; its unbounded strings exclude them.
_LENIENT_STRING_CHAR = r"[^\"\\\r\n]"
_STRICT_STRING_CHAR = r"[^\0-\x1f\"\\\r\n]"


def _no_raw_control_chars(ebnf: str) -> str:
    return ebnf.replace(_LENIENT_STRING_CHAR, _STRICT_STRING_CHAR)


def _choice_ebnf(spec: str) -> str:
    choices = json.loads(spec)
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError("choice must be a non-empty list of strings")
    # JSON string literals are valid EBNF string literals (same escapes).
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


# xgrammar's C++ errors lead with "[HH:MM:SS] /path/to/file.cc:LINE: ": where it was
# raised, which says nothing to the client.
_SOURCE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    if not text:
        return type(e).__name__
    return _SOURCE_PREFIX.sub("", text.splitlines()[0])[:300]


def apply_grammar_masks(
    logits: torch.Tensor, matchers: Sequence[xgr.GrammarMatcher | None], vocab_size: int
) -> torch.Tensor:
    """Mask, in one batched call, the rows whose request has a live grammar; others untouched."""
    rows = [i for i, m in enumerate(matchers) if m is not None and not m.is_terminated()]
    if not rows:
        return logits
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(matchers), vocab_size)
    for i in rows:
        matchers[i].fill_next_token_bitmask(bitmask, i)  # type: ignore[union-attr]
    if logits.dtype != torch.float32:
        logits = logits.float()
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
    return logits
