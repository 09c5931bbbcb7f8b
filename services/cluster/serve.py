"""``baton serve``: start Ray, the workers and the OpenAI-compatible gateway.

    baton serve --config deploy/configs/local.yaml [--model tiny|DIR] [--port 8000] ...

Flags override the YAML; ``BATON_API_KEY`` is read here (and only here) when
``--api-key-file`` is not given (the key never goes on the command line, where ``ps`` shows it). The process serves until SIGINT/SIGTERM, then
drains: the gateway stops, the workers are shut down, Ray is stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import math
import os
import signal
import socket
import sys
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from services.cluster.join import join
from services.config import ClusterConfig, load_config
from services.heap import freeze_startup_heap

__all__ = [
    "ADDRESS_IN_USE_EXIT",
    "add_arguments",
    "api_key",
    "build_config",
    "build_gateway",
    "check_backend_options",
    "check_model_here",
    "run",
    "serve",
]

log = logging.getLogger("baton.serve")

# The exit status when the gateway's address is taken: told apart from the other
# failures, so a script (or a test harness) can pick another port and start again.
ADDRESS_IN_USE_EXIT = 3


def add_arguments(
    parser: argparse.ArgumentParser,
    ray_address_help: str = "join this Ray cluster (default: $RAY_ADDRESS; else start one)",
) -> None:
    parser.add_argument("--config", help="cluster config YAML (default: built-in defaults)")
    parser.add_argument(
        "--model", help="'tiny', 'tiny-vl' (built in) or a local Hugging Face model folder"
    )
    parser.add_argument("--served-model-name", help="the model id clients send")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--host", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to bind (default 8000)")
    parser.add_argument("--prefill", type=int, help="number of prefill workers")
    parser.add_argument("--decode", type=int, help="number of decode workers")
    parser.add_argument("--encode", type=int, help="number of encode workers (images)")
    parser.add_argument("--mode", choices=["disaggregated", "colocated"])
    parser.add_argument("--backend", choices=["embedded", "vllm"], help="engine backend")
    parser.add_argument("--kv-backend", choices=["nixl", "torch", "local"])
    parser.add_argument("--policy", help="router policy (round_robin, slo_goodput, ...)")
    parser.add_argument(
        "--api-key-file",
        help="require the bearer key in this file (default: $BATON_API_KEY); never a key "
        "on the command line, where any user's ps shows it",
    )
    parser.add_argument(
        "--api-keys-file",
        help="several keys: a file of key names -> salted hashes and per-key limits "
        "(`baton keys add` writes it)",
    )
    parser.add_argument(
        "--tool-call-parser", help="hermes, llama3_json, or any of vLLM's registered tool parsers"
    )
    parser.add_argument("--reasoning-parser", choices=["deepseek_r1", "qwen3"])
    parser.add_argument("--worker-cpus", type=float, help="Ray CPUs per worker")
    parser.add_argument("--ray-address", help=ray_address_help)
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])


def build_config(args: argparse.Namespace, environ: dict[str, str] | None = None) -> ClusterConfig:
    environ = dict(os.environ) if environ is None else environ
    config = load_config(args.config)
    return config.with_overrides(
        {
            "model.name": args.model,
            "model.served_model_name": args.served_model_name,
            "model.dtype": args.dtype,
            "gateway.host": args.host,
            "gateway.port": args.port,
            "gateway.api_key": api_key(args.api_key_file, environ),
            "gateway.api_keys_file": getattr(args, "api_keys_file", None),
            "gateway.tool_call_parser": args.tool_call_parser,
            "gateway.reasoning_parser": args.reasoning_parser,
            "workers.prefill": args.prefill,
            "workers.decode": args.decode,
            "workers.encode": getattr(args, "encode", None),
            "workers.mode": args.mode,
            "engine.backend": getattr(args, "backend", None),
            "workers.num_cpus": args.worker_cpus,
            "kvtransfer.backend": args.kv_backend,
            "router.policy": args.policy,
        }
    )


def api_key(path: str | None, environ: dict[str, str]) -> str | None:
    """The single key from ``path``, else ``$BATON_API_KEY``, else None."""
    if path:
        with open(path, encoding="utf-8") as f:
            key = f.read().strip()
        if not key:
            raise ValueError(f"--api-key-file {path}: the file is empty")
        return key
    return environ.get("BATON_API_KEY") or None


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from services.engine.messages import EngineError  # with torch: not for every command

    try:
        config = build_config(args)
        check_backend_options(config)
        check_model_here(config)
    except (ValueError, KeyError, OSError, EngineError) as e:
        print(f"baton serve: invalid configuration: {e}", file=sys.stderr)
        return 2
    ray_address = args.ray_address or os.environ.get("RAY_ADDRESS") or None
    return asyncio.run(serve(config, log_level=args.log_level, ray_address=ray_address))


async def serve(
    config: ClusterConfig,
    *,
    log_level: str = "info",
    ray_address: str | None = None,
    gateway_only: bool = False,
) -> int:
    """Serve until a signal; ``ray_address``: join that Ray cluster instead of starting one;
    ``gateway_only``: the workers are the running control plane's (``baton gateway``).
    Returns the exit status: 0 after a clean stop, ``ADDRESS_IN_USE_EXIT`` when the
    gateway's address is taken."""
    # The address is taken before Ray, the workers and the model: a port in use is
    # reported at once, not after minutes of loading, and nothing binds it meanwhile.
    try:
        listener = bind_listener(config.gateway.host, config.gateway.port)
    except OSError as e:
        in_use = e.errno == errno.EADDRINUSE
        reason = "address already in use" if in_use else e.strerror or str(e)
        where = f"{config.gateway.host}:{config.gateway.port}"
        print(f"baton: cannot listen on {where}: {reason}", file=sys.stderr)
        return ADDRESS_IN_USE_EXIT if in_use else 1
    try:
        return await _serve_on(listener, config, log_level, ray_address, gateway_only)
    finally:
        listener.close()


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not yet listening: connections are refused
    until the gateway serves), with ``SO_REUSEADDR`` as uvicorn binds its own. It says
    ``IPPROTO_TCP``: asyncio sets ``TCP_NODELAY`` only on connections accepted from such
    a socket, and without it a response written in two parts (a 429's head, then its
    body) waited for the client's delayed ACK, about 40 ms."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


async def _serve_on(
    listener: socket.socket,
    config: ClusterConfig,
    log_level: str,
    ray_address: str | None,
    gateway_only: bool,
) -> int:
    import ray

    from services.gateway.app import create_app
    from services.gateway.connections import uvicorn_config

    local_gpus = _local_gpus(config)
    if ray.is_initialized():
        pass  # the caller joined the cluster already (``baton gateway``)
    elif ray_address:
        if not join(ray_address, "baton serve", "baton", log_to_driver=log_level == "debug"):
            return 1
    else:
        ray.init(
            num_cpus=_ray_cpus(config),
            num_gpus=None if local_gpus else 0,
            include_dashboard=False,
            log_to_driver=log_level == "debug",
            namespace="baton",
        )
    cluster_has_gpus = ray.cluster_resources().get("GPU", 0) > 0
    if gateway_only:  # the control plane launched its workers from the same config
        svc, layout = build_gateway(config), _launched_layout(config, _worker_specs(config))
    else:
        svc, layout = _build_service(config, cluster_has_gpus)
    app = create_app(svc)
    server = _server_class()(
        uvicorn_config(
            app,
            config.gateway,
            host=config.gateway.host,
            port=config.gateway.port,
            log_level="warning",
            timeout_graceful_shutdown=5,
        )
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, server.request_exit)
    announce = asyncio.create_task(_announce_when_started(server, config, layout))
    try:
        await server.serve(sockets=[listener])
    finally:
        announce.cancel()
        ray.shutdown()
    return 0 if server.started else 1


def _server_class() -> Any:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, with the signals ours: a SIGTERM is a clean exit (status 0),
        not re-raised after shutdown into Ray's handler."""

        @contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

        def request_exit(self) -> None:
            self.should_exit = True

    return Server


def _build_service(config: ClusterConfig, cluster_has_gpus: bool) -> tuple[Any, str]:
    """The service, and its layout as the start-up line tells it."""
    from services.cluster.launchers import RayLauncher
    from services.engine.loader import load_tokenizer
    from services.gateway.service import GatewayService, GatewaySettings

    specs = _worker_specs(config, cluster_has_gpus)
    settings = GatewaySettings(
        config.gateway, config.router, config.model, config.kvtransfer.backend
    )
    launcher = RayLauncher(num_cpus=config.workers.num_cpus, num_gpus=0.0)
    svc = GatewayService(settings, load_tokenizer(config.model.name), specs, launcher)
    return svc, _launched_layout(config, specs)


def _launched_layout(config: ClusterConfig, specs: Sequence[Any]) -> str:
    """``disaggregated: 1 prefill, 1 decode; kv=nixl``: the workers launched (colocated,
    they are all mixed) and what moves KV between them (none colocated; vLLM's own
    connector on the vllm backend)."""
    counts = Counter(spec.role.value for spec in specs)
    roles = ", ".join(f"{n} {role}" for role, n in counts.items()) or "no workers"
    kv: str = config.kvtransfer.backend
    if not any(spec.connector_factory is not None for spec in specs):
        split = config.workers.mode != "colocated"
        kv = "vLLM's NixlConnector" if split and config.engine.backend == "vllm" else "none"
    return f"{config.workers.mode}: {roles}; kv={kv}"


def _worker_specs(config: ClusterConfig, cluster_has_gpus: bool = False) -> list[Any]:
    from services.cluster.factories import factories_for
    from services.cluster.specs import worker_specs

    return worker_specs(config, *factories_for(config), cluster_has_gpus=cluster_has_gpus)


def build_gateway(config: ClusterConfig) -> Any:
    """A gateway over the control plane already running in the Ray cluster."""
    from services.cluster.control_plane import NAMESPACE, find_control_plane
    from services.cluster.remote import RemoteController, find_ray_worker_of
    from services.engine.loader import load_tokenizer
    from services.gateway.service import GatewayService, GatewaySettings

    plane = find_control_plane()
    if plane is None:
        raise RuntimeError("no Baton control plane in this Ray cluster: run `baton cluster up`")
    settings = GatewaySettings(
        config.gateway, config.router, config.model, config.kvtransfer.backend
    )
    return GatewayService(
        settings,
        load_tokenizer(config.model.name),
        (),
        _no_launch,
        remote_controller=lambda on_snapshot, on_down, on_up: RemoteController(
            plane,
            find_ray_worker_of(NAMESPACE),
            on_snapshot=on_snapshot,
            on_worker_down=on_down,
            on_worker_up=on_up,
            find_plane=find_control_plane,
        ),
    )


def _no_launch(spec: Any) -> Any:
    raise AssertionError(f"a gateway over a control plane launches no worker ({spec.worker_id})")


async def _announce_when_started(server: Any, config: ClusterConfig, layout: str) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    freeze_startup_heap()  # the workers are up and the model loaded: serving starts now
    host, port = config.gateway.host, config.gateway.port
    for s in server.servers:
        for sock in s.sockets:
            host, port = sock.getsockname()[:2]
    print(
        f"Baton is serving {config.model.public_name!r} at http://{host}:{port}/v1 ({layout})",
        flush=True,
    )


def check_backend_options(config: ClusterConfig) -> None:
    """Refuse, before any worker starts, a router policy that does not exist (the
    gateway would fall back to round_robin), backend options the backend does not take,
    a tool-call parser nobody provides and a key file the gateway could not read."""
    from router import available_policies
    from services.gateway.access import key_table
    from services.gateway.parsers import check_tool_call_parser

    if config.router.policy not in available_policies():
        raise ValueError(
            f"router.policy {config.router.policy!r} is not a policy; "
            f"available: {', '.join(available_policies())}"
        )
    check_tool_call_parser(config.gateway.tool_call_parser)
    key_table(config.gateway)
    if config.engine.backend == "vllm":
        from services.backends.vllm import check_vllm_options
        from services.engine.loader import BUILT_IN_MODELS

        check_vllm_options(config.engine.vllm)
        if config.model.name in BUILT_IN_MODELS:
            raise ValueError(
                f"engine.backend vllm serves a local model folder; {config.model.name!r} is "
                "built into Baton's embedded engine (engine.backend: embedded)"
            )
    elif config.engine.vllm:
        raise ValueError(
            f"engine.vllm is set but engine.backend is {config.engine.backend!r}; "
            "set engine.backend: vllm or remove engine.vllm"
        )


def check_model_here(config: ClusterConfig) -> None:
    """Refuse, before Ray starts, a model this machine cannot read: the gateway loads
    its tokenizer here (``ModelLoadError``: a built-in name or a local folder with a
    config.json, never a download)."""
    from services.engine.loader import check_model_source

    check_model_source(config.model.name)


def _local_gpus(config: ClusterConfig) -> bool:
    """Whether a Ray started here should offer this machine's GPUs."""
    if config.engine.device == "cpu":
        return False
    import torch

    return bool(torch.cuda.is_available())


def _ray_cpus(config: ClusterConfig) -> int:
    w = config.workers
    needed = (w.prefill + w.decode + w.mixed) * w.num_cpus
    return max(os.cpu_count() or 1, math.ceil(needed) + 1)
