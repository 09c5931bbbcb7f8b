"""Structured outputs in the embedded engine: masks, termination, replay, cache, errors."""

from __future__ import annotations

import json
import re
import sys
import time

import jsonschema
import pytest

from services.engine.engine import LLMEngine
from services.engine.messages import (
    MAX_GRAMMAR_SPEC_BYTES,
    EngineRequest,
    FinishReason,
    InvalidRequestError,
    SamplingParams,
    StructuredOutput,
)
from tests.unit.engine.engine_helpers import make_engine, run_all, serve, tokens_of

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
JSON = StructuredOutput("json", json.dumps(SCHEMA), param="response_format")
SAMPLINGS = [
    pytest.param(dict(temperature=0.0), id="greedy"),
    pytest.param(dict(temperature=1.0, seed=11), id="seeded"),
]


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return make_engine()


def _run(engine: LLMEngine, rid: str, text: str, **kw: object) -> tuple[list[int], FinishReason]:
    kw.setdefault("max_tokens", 120)
    engine.add_request(EngineRequest(rid, tuple(engine.encode(text)), SamplingParams(**kw)))  # type: ignore[arg-type]
    outs = run_all(engine)[rid]
    reason = outs[-1].finish_reason
    assert reason is not None
    return tokens_of(outs), reason


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_json_schema_output_validates_is_compact_and_stops(
    engine: LLMEngine, sampling: dict[str, object]
) -> None:
    for i, prompt in enumerate(["hello", "Describe a cat.", "{", "numbers: 1 2 3"]):
        ids, reason = _run(engine, f"j{i}", prompt, structured=JSON, **sampling)
        text = engine.decode(ids)
        jsonschema.validate(json.loads(text), SCHEMA)
        assert reason is FinishReason.STOP  # the grammar ended, not max_tokens
        assert not re.search(r'[\s](?=(?:[^"]*"[^"]*")*[^"]*$)', text), text  # no free whitespace


def test_unconstrained_rows_are_untouched_by_a_constrained_neighbour(engine: LLMEngine) -> None:
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = tuple(engine.encode("relay"))
    alone = serve(engine, [EngineRequest("alone", prompt, plain)])["alone"]
    batch = serve(
        engine,
        [
            EngineRequest(
                "c1", prompt, SamplingParams(max_tokens=12, temperature=0.0, structured=JSON)
            ),
            EngineRequest("p", prompt, plain),
        ],
    )
    assert batch["p"] == alone
    assert batch["c1"] != alone


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_a_continuation_rebuilds_the_grammar_from_committed_tokens(
    engine: LLMEngine, sampling: dict[str, object]
) -> None:
    """What a decode worker or a failover target does: replay the outputs, then go on."""
    full, _ = _run(engine, "full", "Describe a cat.", structured=JSON, **sampling)
    prompt = tuple(engine.encode("Describe a cat."))
    other = make_engine()  # another worker: a fresh compiler and cache
    for k in (1, len(full) // 2, len(full) - 1):
        params = SamplingParams(max_tokens=120, structured=JSON, **sampling)  # type: ignore[arg-type]
        request = EngineRequest(f"cont{k}", prompt, params, output_token_ids=tuple(full[:k]))
        rest = serve(other, [request])[f"cont{k}"]
        assert full[:k] + rest == full


def test_choice_and_regex_always_hold(engine: LLMEngine) -> None:
    choices = ["yes", "no", "not sure"]
    choice = StructuredOutput("choice", json.dumps(choices))
    regex = StructuredOutput("regex", r"[A-Z][a-z]{2,5}-\d{3}")
    for seed in range(8):
        ids, reason = _run(
            engine, f"c{seed}", "pick", structured=choice, temperature=1.0, seed=seed
        )
        assert engine.decode(ids) in choices and reason is FinishReason.STOP
        ids, _ = _run(engine, f"r{seed}", "code", structured=regex, temperature=1.0, seed=seed)
        assert re.fullmatch(r"[A-Z][a-z]{2,5}-\d{3}", engine.decode(ids))


def test_grammar_and_json_object_and_whitespace_on_request(engine: LLMEngine) -> None:
    ebnf = StructuredOutput("grammar", 'root ::= "ab" [0-9] ("x" | "yz")')
    ids, _ = _run(engine, "g", "go", structured=ebnf, temperature=1.0, seed=1)
    assert re.fullmatch(r"ab[0-9](x|yz)", engine.decode(ids))
    ids, reason = _run(
        engine, "o", "go", structured=StructuredOutput("json_object"), temperature=0.0
    )
    assert isinstance(json.loads(engine.decode(ids)), dict) and reason is FinishReason.STOP
    loose = StructuredOutput("json", JSON.spec, any_whitespace=True)
    assert engine.grammars.compile(loose) is not engine.grammars.compile(JSON)


def test_compiles_are_cached_per_schema(engine: LLMEngine) -> None:
    spec = StructuredOutput("regex", r"cache-[0-9]{4}")
    engine.grammars.compile(spec)
    before = engine.grammars.num_compiles
    start = time.perf_counter()
    engine.grammars.compile(StructuredOutput("regex", r"cache-[0-9]{4}"))
    assert engine.grammars.num_compiles == before
    assert time.perf_counter() - start < 1e-3


@pytest.mark.parametrize(
    ("structured", "param"),
    [
        (
            StructuredOutput("json", '{"type": "nonsense"}', param="response_format"),
            "response_format",
        ),
        (StructuredOutput("json", "{not json", param="response_format"), "response_format"),
        (StructuredOutput("regex", "([a-z"), "structured_outputs"),
        (StructuredOutput("grammar", "root ::= ("), "structured_outputs"),
        (StructuredOutput("choice", "[]"), "structured_outputs"),
        (
            StructuredOutput("json", json.dumps({"enum": ["x" * MAX_GRAMMAR_SPEC_BYTES]})),
            "structured_outputs",
        ),
    ],
)
def test_bad_constraints_are_refused_fast_and_the_engine_keeps_serving(
    engine: LLMEngine, structured: StructuredOutput, param: str
) -> None:
    start = time.perf_counter()
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request(
            EngineRequest("bad", (1, 2, 3), SamplingParams(max_tokens=4, structured=structured))
        )
    assert time.perf_counter() - start < 1.0
    assert e.value.param == param
    assert not engine.has_unfinished()
    ids, _ = _run(engine, "after", "ok", max_tokens=3, temperature=0.0, ignore_eos=True)
    assert len(ids) == 3


def test_a_refused_constraint_says_why_without_where_in_xgrammar_it_was_raised(
    engine: LLMEngine,
) -> None:
    schema = json.dumps({"type": "nonsense"})
    structured = StructuredOutput("json", schema, param="response_format")
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request(
            EngineRequest("bad", (1, 2, 3), SamplingParams(max_tokens=4, structured=structured))
        )
    message = str(e.value)
    assert message.startswith('invalid json constraint: Unsupported type "nonsense"'), message
    assert ".cc:" not in message, message


def test_logit_bias_forces_and_forbids_tokens(engine: LLMEngine) -> None:
    base, _ = _run(engine, "base", "hello", max_tokens=6, temperature=0.0, ignore_eos=True)
    forced, _ = _run(
        engine,
        "forced",
        "hello",
        max_tokens=6,
        temperature=0.0,
        ignore_eos=True,
        logit_bias=((ord("Q"), 100.0),),
    )
    assert forced == [ord("Q")] * 6
    banned, _ = _run(
        engine,
        "banned",
        "hello",
        max_tokens=1,
        temperature=0.0,
        ignore_eos=True,
        logit_bias=((base[0], -100.0),),
    )
    assert banned[0] != base[0]


@pytest.mark.parametrize(
    "bias", [((0, 100.5),), ((-1, 1.0),), tuple((i, 1.0) for i in range(2000)), ((10_000, 1.0),)]
)
def test_logit_bias_is_bounded(engine: LLMEngine, bias: tuple[tuple[int, float], ...]) -> None:
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request(EngineRequest("lb", (1, 2), SamplingParams(logit_bias=bias)))
    assert e.value.param == "logit_bias"


_FRESH_FIRST_COMPILE = """
import json
from services.engine.grammar import GrammarCompiler
from services.engine.messages import StructuredOutput
from services.engine.tokenizer import ByteTokenizer

compiler = GrammarCompiler(ByteTokenizer(), 320, [ByteTokenizer.EOS], compile_timeout_s=0.5)
compiler.compile(StructuredOutput("json", json.dumps({"type": "object"}), param="response_format"))
print("compiled")
"""


@pytest.mark.slow
def test_the_first_compile_in_a_fresh_process_fits_the_deadline() -> None:
    """xgrammar takes seconds to import: a compiler imports it when built, so a fresh
    worker's first constrained request is not refused for its 0.5 s compile deadline."""
    import subprocess

    done = subprocess.run(
        [sys.executable, "-c", _FRESH_FIRST_COMPILE], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-2000:]


def test_without_xgrammar_a_constraint_is_a_400_naming_its_field(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from services.engine.grammar import GrammarCompiler
    from services.engine.tokenizer import ByteTokenizer

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar: ImportError
    compiler = GrammarCompiler(ByteTokenizer(), 320, [ByteTokenizer.EOS])
    with pytest.raises(InvalidRequestError, match="need xgrammar") as err:
        compiler.compile(JSON)
    assert err.value.param == "response_format"
