"""ClusterConfig: one pydantic model, loaded from YAML, overridden by CLI flags.

Each component receives only its own section. Environment variables are read
only by the CLI and deploy/, never here.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = [
    "ClusterConfig",
    "EngineConfig",
    "GatewayConfig",
    "ImagesConfig",
    "KVTransferConfig",
    "ModelConfig",
    "RouterConfig",
    "SLOConfig",
    "WorkersConfig",
    "load_config",
    "validated_config",
    "yaml_error_where",
]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Section):
    name: str = Field(
        "tiny", description="'tiny' or 'tiny-vl' (built in) or a local Hugging Face folder"
    )
    served_model_name: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    seed: int = 0

    @property
    def public_name(self) -> str:
        return self.served_model_name or Path(self.name).name


class EngineConfig(_Section):
    backend: Literal["embedded", "vllm"] = "embedded"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    block_size: int = Field(16, ge=1, le=1024)
    kv_cache_bytes: int = Field(64 * 2**20, ge=1, description="KV pool size per worker, bytes")
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    long_prefill_token_threshold: int = Field(
        0,
        ge=0,
        description="while more than one request is in the engine, the most prompt tokens "
        "one request prefills in a step (0: the step's budget): a long prompt goes in "
        "chunks, and a short one that arrives meanwhile starts in the next step instead of "
        "after it (vLLM's option of the same name)",
    )
    max_model_len: int | None = Field(None, ge=1)
    enable_prefix_caching: bool = True
    admission: Literal["past_future", "blocks"] = Field(
        "past_future",
        description="admit waiting requests by the past-future peak estimate, or by free blocks now",
    )
    num_threads: int | None = Field(None, ge=1, description="torch CPU threads per worker")
    packed_linears: bool = Field(
        True,
        description="embedded, CPU float32: keep a oneDNN-packed second copy of each large "
        "linear weight (faster steps above one row; one more copy of those weights in memory)",
    )
    cpu_kernels: bool = Field(
        True,
        description="embedded, CPU: run decode attention over the paged KV cache, RMSNorm and "
        "rotary + KV write in C++ kernels, compiled once per machine with the host's g++ "
        "(torch ops if they cannot build)",
    )
    vllm: dict[str, Any] = Field(
        default_factory=dict,
        description="backend vllm: extra vLLM EngineArgs (dtype, enforce_eager, "
        "gpu_memory_utilization, tensor_parallel_size, ...); unknown names are refused at start",
    )


class WorkersConfig(_Section):
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    prefill: int = Field(1, ge=0)
    decode: int = Field(1, ge=0)
    mixed: int = Field(0, ge=0)
    encode: int = Field(0, ge=0)
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float | None = Field(
        None,
        ge=0,
        description="GPUs per worker; None: tensor_parallel_size on GPU clusters, else 0",
    )
    gpus_per_role: dict[Literal["prefill", "decode", "mixed", "encode"], float] = Field(
        default_factory=dict,
        description="GPUs per worker by role (the Helm chart sets it from its worker groups)",
    )
    telemetry_interval_s: float = Field(0.1, gt=0, le=1.0)
    nice: int = Field(
        0,
        ge=0,
        le=19,
        description="added to each worker's nice value (its engine threads): on a CPU host "
        "shared with the gateway, admission keeps answering quickly while engines run flat out",
    )
    prefill_nice: int | None = Field(
        None,
        ge=0,
        le=19,
        description="the same for prefill and encode engines (None: nice); below nice, a "
        "prompt's prefill step keeps its speed when decode batches share its cores (a role "
        "flip moves the engine to its new role's value; lowering it needs CAP_SYS_NICE)",
    )

    @model_validator(mode="after")
    def _has_workers(self) -> WorkersConfig:
        if (
            self.mode == "disaggregated"
            and (self.prefill == 0 or self.decode == 0)
            and self.mixed == 0
        ):
            raise ValueError(
                "disaggregated mode needs at least one prefill and one decode worker (or mixed workers)"
            )
        if self.mode == "colocated" and self.prefill + self.decode + self.mixed == 0:
            raise ValueError("colocated mode needs at least one worker")
        return self


class KVTransferConfig(_Section):
    backend: Literal["nixl", "torch", "local"] = "nixl"
    lease_s: float = Field(30.0, gt=0)
    transfer_timeout_s: float = Field(10.0, gt=0)


class SLOConfig(_Section):
    ttft_ms: float = Field(2000.0, gt=0)
    tpot_ms: float = Field(200.0, gt=0)


class CorrectionConfig(_Section):
    """How each worker's cost model is corrected from its requests' measured TTFT/TPOT."""

    window: int = Field(32, ge=2, le=4096, description="latest (predicted, observed) pairs fitted")
    min_samples: int = Field(4, ge=1, description="fewer pairs: predictions are used as they are")
    min_scale: float = Field(0.25, gt=0, le=1, description="the fitted scale is clamped to this")
    max_scale: float = Field(8.0, ge=1, le=1000, description="and to this")
    max_age_s: float = Field(
        30.0, gt=0, le=3600, description="pairs older than this are forgotten (seconds)"
    )

    @model_validator(mode="after")
    def _fits_in_window(self) -> CorrectionConfig:
        if self.min_samples > self.window:
            raise ValueError(
                f"min_samples ({self.min_samples}) must not exceed window ({self.window})"
            )
        return self


class AdmissionConfig(_Section):
    """Refusing at once (429 + Retry-After) what the corrected cost model says will miss."""

    enabled: bool = Field(True, description="false: policies' plans are never judged")
    headroom: float = Field(
        1.0,
        gt=0,
        le=1,
        description="interactive requests must fit within this share of each target",
    )
    batch_headroom: float = Field(
        0.8, gt=0, le=1, description="batch requests must fit within this share of each target"
    )
    min_retry_after_s: float = Field(1.0, gt=0, le=3600, description="least Retry-After sent")
    adaptive: bool = Field(
        True,
        description="scale both headrooms down while admitted requests miss their targets "
        "(each miss takes 0.05 off, down to half; each success gives some back)",
    )
    correction: CorrectionConfig = CorrectionConfig()


class RouterConfig(_Section):
    policy: str = "slo_goodput"
    default_slo: SLOConfig = SLOConfig()
    length_split: Literal["temporal", "spatial"] = Field(
        "spatial",
        description="spatial: long prompts get their own prefill workers (the engine serves a worker FCFS); temporal: shared",
    )
    length_threshold_tokens: int | None = Field(
        None, ge=1, description="None: the knee of the prefill curve"
    )
    profile: str | None = Field(
        None, description="cost-model seed profile JSON; None: the shipped one"
    )
    max_hold_s: float = Field(
        5.0, ge=0, description="longest a request waits at the gateway for capacity"
    )
    memory_fraction: float = Field(0.95, gt=0, le=1)
    rebalance_interval_s: float = Field(10.0, gt=0)
    admission: AdmissionConfig = AdmissionConfig()


class ImagesConfig(_Section):
    """Bounds on images in chat requests (multimodal models); each breach is a 400."""

    max_images_per_request: int = Field(8, ge=0)
    max_image_bytes: int = Field(8 * 2**20, ge=1, description="per image, as sent (decoded base64)")
    max_image_pixels: int = Field(
        4096 * 4096, ge=1, description="width x height from the header, checked before decoding"
    )
    fetch_hosts: list[str] = Field(
        default_factory=list,
        description="hosts http(s) image URLs may name; empty: remote fetching is off",
    )
    fetch_timeout_s: float = Field(5.0, gt=0)


class GatewayConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: str | None = None
    api_keys_file: str | None = Field(
        None,
        description="YAML/JSON file of key names -> salted hashes and per-key limits "
        "(services/gateway/keys.py; `baton keys add` writes it)",
    )
    max_body_bytes: int = Field(4 * 2**20, ge=1024)
    max_inflight_requests: int = Field(1024, ge=1)
    request_timeout_s: float = Field(
        600.0, gt=0, description="a request's whole life; past it: 504, or an error event"
    )
    max_sequences_per_request: int = Field(
        64, ge=1, description="prompts x n in one request; more is a 400 naming n"
    )
    max_stop_strings: int = Field(16, ge=1, description="stop strings per request; more is a 400")
    max_stop_string_chars: int = Field(
        1024, ge=1, description="characters in one stop string; longer is a 400"
    )
    max_header_bytes: int = Field(
        32 * 2**10, ge=1024, description="request line + headers; more is a 431"
    )
    header_timeout_s: float = Field(
        10.0, gt=0, description="a connection's next request headers must arrive within this"
    )
    body_timeout_s: float = Field(
        30.0,
        gt=0,
        description="a request's body must arrive within this from its headers; else a 408",
    )
    keep_alive_timeout_s: float = Field(5.0, gt=0, description="idle keep-alive connections close")
    max_connections: int = Field(
        2048, ge=1, description="open HTTP connections; a request on one past it gets a 503"
    )
    stream_write_timeout_s: float = Field(
        30.0,
        gt=0,
        description="a stream whose client reads nothing this long is cut, its request aborted",
    )
    tool_call_parser: str | None = Field(
        None,
        description="parse tool calls out of tool_choice=auto output: hermes, llama3_json, or any "
        "parser vLLM registers (None: answer as text); checked by name at start",
    )
    reasoning_parser: Literal["deepseek_r1", "qwen3"] | None = Field(
        None, description="split <think>...</think> into message.reasoning"
    )
    images: ImagesConfig = ImagesConfig()


class ClusterConfig(_Section):
    model: ModelConfig = ModelConfig()
    engine: EngineConfig = EngineConfig()
    workers: WorkersConfig = WorkersConfig()
    kvtransfer: KVTransferConfig = KVTransferConfig()
    router: RouterConfig = RouterConfig()
    gateway: GatewayConfig = GatewayConfig()

    def with_overrides(self, overrides: dict[str, Any]) -> ClusterConfig:
        """Apply dotted overrides such as ``{"workers.prefill": 2}``; None values are skipped."""
        data = self.model_dump()
        for dotted, value in overrides.items():
            if value is None:
                continue
            node = data
            *parents, leaf = dotted.split(".")
            for p in parents:
                node = node[p]
            if leaf not in node:
                raise KeyError(f"unknown config key {dotted!r}")
            node[leaf] = value
        return validated_config(data)

    def differences(self, other: ClusterConfig) -> list[str]:
        """Each dotted key whose value differs, as ``key: this, other`` (secrets as
        ``differs``): what ``baton cluster up`` names when the plane already running was
        started with another configuration."""
        lines: list[str] = []
        _differences(self.model_dump(), other.model_dump(), "", lines)
        return lines


_SECRET_KEYS = frozenset({"api_key"})


def _differences(a: Any, b: Any, prefix: str, lines: list[str]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in a:
            _differences(a[key], b.get(key), f"{prefix}{key}.", lines)
    elif a != b:
        key = prefix.removesuffix(".")
        shown = "differs" if key.rsplit(".", 1)[-1] in _SECRET_KEYS else f"{a!r}, {b!r}"
        lines.append(f"{key}: {shown}")


def load_config(path: str | Path | None) -> ClusterConfig:
    """Load a ClusterConfig from YAML (None: the defaults)."""
    if path is None:
        return ClusterConfig()
    text = Path(path).read_text()
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML{yaml_error_where(e)}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    return validated_config(data, f"{path}: ")


def validated_config(data: dict[str, Any], where: str = "") -> ClusterConfig:
    """``ClusterConfig`` of ``data``, or a ValueError saying, per problem, the dotted
    field, what is wrong and the value given (pydantic's own text adds its error type,
    the whole section as input and a link: three lines per problem)."""
    try:
        return ClusterConfig.model_validate(data)
    except ValidationError as e:
        problems = []
        for error in e.errors():
            field = ".".join(str(part) for part in error["loc"]) or "config"
            message = str(error["msg"]).removeprefix("Value error, ")
            given = error.get("input")
            got = (
                "" if isinstance(given, dict) or error["type"] == "missing" else f" (got {given!r})"
            )
            if error["type"] == "extra_forbidden":
                message = _unknown_key(tuple(error["loc"]))
            problems.append(f"{field}: {message}{got}")
        raise ValueError(where + "; ".join(problems)) from e


def _unknown_key(loc: tuple[Any, ...]) -> str:
    """'unknown key' with the section's key it is likely a typo of, else the section's
    keys (a typo like ``workers.prefil`` otherwise reads as 'Extra inputs are not
    permitted', which names no fix)."""
    section: Any = ClusterConfig
    for part in loc[:-1]:
        field = section.model_fields.get(part) if isinstance(part, str) else None
        annotation = None if field is None else field.annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return "unknown key"
        section = annotation
    keys = list(section.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), keys, n=1)
    if close:
        return f"unknown key; did you mean {close[0]!r}?"
    return f"unknown key; {'.'.join(map(str, loc[:-1])) or 'the top level'} takes {', '.join(keys)}"


def yaml_error_where(e: yaml.YAMLError) -> str:
    """' at line L, column C: what the parser found' (1-based), as far as it says; never
    the text around it (a key file's line holds a hash)."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None)
    where = "" if mark is None else f" at line {mark.line + 1}, column {mark.column + 1}"
    return f"{where}: {problem}" if problem else where
