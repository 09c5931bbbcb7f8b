"""``baton serve`` flags over the YAML; the API key from the environment only in the CLI."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from router.types import Role
from services.cluster.factories import FakeEngineFactory
from services.cluster.serve import add_arguments, build_config
from services.cluster.specs import worker_specs


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(allow_abbrev=False)  # as services/cli.py builds it
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_flags_override_the_yaml() -> None:
    args = parse(
        "--config", "deploy/configs/local.yaml", "--prefill", "2", "--decode", "3",
        "--kv-backend", "torch", "--policy", "least_loaded", "--port", "9001",
        "--served-model-name", "mine", "--dtype", "float32",
    )  # fmt: skip
    config = build_config(args, environ={})
    assert (config.workers.prefill, config.workers.decode) == (2, 3)
    assert config.kvtransfer.backend == "torch" and config.router.policy == "least_loaded"
    assert config.gateway.port == 9001 and config.model.public_name == "mine"
    assert config.engine.block_size == 16  # untouched YAML values stay
    roles = [s.role for s in worker_specs(config, FakeEngineFactory(), None)]
    assert roles == [Role.PREFILL] * 2 + [Role.DECODE] * 3


def test_colocated_mode_makes_mixed_workers_without_connectors() -> None:
    config = build_config(parse("--mode", "colocated", "--prefill", "1", "--decode", "1"), {})
    specs = worker_specs(config, FakeEngineFactory(), lambda name: None)  # type: ignore[arg-type,return-value]
    assert [s.role for s in specs] == [Role.MIXED, Role.MIXED]
    assert all(s.connector_factory is None for s in specs)


def test_api_key_from_a_file_or_the_environment_never_a_flag(tmp_path: Path) -> None:
    assert build_config(parse(), {"BATON_API_KEY": "env-key"}).gateway.api_key == "env-key"
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    args = parse("--api-key-file", str(key_file))
    assert build_config(args, {"BATON_API_KEY": "e"}).gateway.api_key == "from-file"
    assert build_config(parse(), {}).gateway.api_key is None
    with pytest.raises(SystemExit):  # a key on the command line is not accepted at all
        parse("--api-key", "sekret")
    key_file.write_text("")
    with pytest.raises(ValueError, match="empty"):
        build_config(parse("--api-key-file", str(key_file)), {})


def test_invalid_combination_is_refused() -> None:
    with pytest.raises(ValueError, match="prefill and one decode"):
        build_config(parse("--mode", "disaggregated", "--prefill", "0"), {})


def test_backend_flag_selects_the_engine_and_vllm_workers_get_no_kvtransfer_connector() -> None:
    from services.cluster.factories import factories_for

    config = build_config(parse("--backend", "vllm", "--model", "/models/x"), environ={})
    assert config.engine.backend == "vllm"
    engine, connector = factories_for(config)
    assert connector is None  # vLLM moves its own KV
    assert engine.kv_lease_s == config.kvtransfer.lease_s
    colocated = config.with_overrides({"workers.mode": "colocated"})
    assert factories_for(colocated)[0].kv_lease_s is None
    embedded_engine, embedded_connector = factories_for(build_config(parse(), environ={}))
    assert embedded_connector is not None and embedded_engine.kv_lease_s is None


def test_vllm_with_encode_workers_pulls_embeddings_and_encodes_on_baton_s_engine() -> None:
    """``--backend vllm --encode 1``: every worker gets a kvtransfer connector (for the
    ``mm`` region only; vLLM's KV moves through its own connector), the encode worker
    runs the embedded engine on the same checkpoint and keeps its role; the text
    workers run vLLM."""
    from services.cluster.factories import EngineFactory, factories_for

    args = parse("--backend", "vllm", "--model", "/models/x", "--encode", "1", "--prefill", "1")
    config = build_config(args, environ={})
    assert config.workers.encode == 1
    specs = {s.worker_id: s for s in worker_specs(config, *factories_for(config))}
    assert set(specs) == {"encode-0", "prefill-0", "decode-0"}
    for spec in specs.values():
        assert spec.connector_factory is not None
        assert isinstance(spec.engine_factory, EngineFactory)
        assert spec.engine_factory.model.name == "/models/x"
    assert specs["encode-0"].engine_factory.backend == "embedded"
    assert specs["encode-0"].fixed_role
    assert {specs[w].engine_factory.backend for w in ("prefill-0", "decode-0")} == {"vllm"}
    assert not specs["prefill-0"].fixed_role
    # Colocated: no encode workers, no connector; the prefilling workers encode.
    colocated = config.with_overrides({"workers.mode": "colocated"})
    assert factories_for(colocated)[1] is None
    assert [s.role for s in worker_specs(colocated, *factories_for(colocated))] == [Role.MIXED] * 2


@pytest.mark.parametrize("folder", ["missing", "no-config"])
def test_a_model_this_machine_cannot_read_is_refused_before_ray_starts(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    folder: str,
) -> None:
    from services.cluster import serve

    (tmp_path / "no-config").mkdir()
    started: list[object] = []
    monkeypatch.setattr(serve, "serve", lambda *a, **k: started.append(a))  # must not run
    status = serve.run(parse("--model", str(tmp_path / folder), "--port", "1"))
    assert status == 2 and not started
    err = capsys.readouterr().err
    assert err.startswith("baton serve: invalid configuration: ") and str(tmp_path / folder) in err


def test_the_built_in_models_need_no_folder() -> None:
    from services.cluster.serve import check_model_here

    for name in ("tiny", "tiny-vl"):
        check_model_here(build_config(parse("--model", name), {}))


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (("--encode", "1"), "(disaggregated: 1 encode, 1 prefill, 1 decode; kv=nixl)"),
        ((), "(disaggregated: 1 prefill, 1 decode; kv=nixl)"),
        # The workers launched, not the flags: colocated, every worker is mixed.
        (("--mode", "colocated", "--decode", "0"), "(colocated: 1 mixed; kv=none)"),
        (("--backend", "vllm"), "(disaggregated: 1 prefill, 1 decode; kv=vLLM's NixlConnector)"),
    ],
)
def test_the_serving_line_counts_the_workers_launched(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: tuple[str, ...],
    says: str,
) -> None:
    import asyncio
    from types import SimpleNamespace

    from services.cluster import serve

    monkeypatch.setattr(serve, "freeze_startup_heap", lambda: None)  # not this process's heap
    config = build_config(parse("--config", "deploy/configs/local.yaml", *argv), {})
    layout = serve._launched_layout(config, serve._worker_specs(config))
    started = SimpleNamespace(started=True, servers=[])
    asyncio.run(serve._announce_when_started(started, config, layout))
    assert capsys.readouterr().out.rstrip().endswith(says)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("workers: [1\n", "not valid YAML at line 2, column 1: expected ',' or ']'"),
        ("a: b: c\n", "not valid YAML at line 1, column 5: mapping values are not allowed"),
        ("- 1\n", "expected a mapping at the top level"),
        ("workers:\n  prefil: 2\n", "workers.prefil: unknown key; did you mean 'prefill'? (got 2)"),
        ("modle:\n  name: tiny\n", "modle: unknown key; did you mean 'model'?"),
        (
            "router:\n  default_slo: {ttft: 5}\n",
            "router.default_slo.ttft: unknown key; did you mean 'ttft_ms'? (got 5)",
        ),
        ("kvtransfer:\n  zzz: 1\n", "kvtransfer.zzz: unknown key; kvtransfer takes backend, "),
        ("gateway:\n  port: 70000\n", "gateway.port: Input should be less than or equal to 65535"),
        (
            "workers:\n  prefill: 0\n  decode: 0\n",
            "workers: disaggregated mode needs at least one prefill and one decode worker",
        ),
        ("router:\n  policy: round_robn\n", "router.policy 'round_robn' is not a policy"),
    ],
)
def test_a_bad_config_file_exits_2_before_anything_starts(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    text: str,
    says: str,
) -> None:
    from services.cluster import serve

    path = tmp_path / "serve.yaml"
    path.write_text(text)
    started: list[object] = []
    monkeypatch.setattr(serve, "serve", lambda *a, **k: started.append(a))  # must not run
    assert serve.run(parse("--config", str(path))) == 2 and not started
    err = capsys.readouterr().err
    assert err.startswith("baton serve: invalid configuration: ") and says in err, err
    assert "Traceback" not in err and "errors.pydantic.dev" not in err
    assert len(err.splitlines()) == 1, err


@pytest.mark.parametrize("model", ["tiny", "tiny-vl"])
def test_vllm_refuses_baton_s_built_in_models_before_starting(model: str) -> None:
    from services.cluster.serve import check_backend_options

    config = build_config(parse("--backend", "vllm", "--model", model), {})
    with pytest.raises(ValueError, match=f"'{model}' is built into Baton's embedded engine"):
        check_backend_options(config)
