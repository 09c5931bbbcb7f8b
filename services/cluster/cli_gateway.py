"""``baton gateway``: one more gateway over a running control plane.

    baton gateway [--ray-address ADDR] [--host 0.0.0.0] [--port 8000] [--api-keys-file keys.yaml]

The cluster's config comes from the controller (``baton cluster up``), so the
model, router and gateway sections match; these flags override the gateway's own
settings and the router policy. The gateway places requests with its own Router
from every worker's telemetry; stopping or killing it leaves the workers serving
the other gateways.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from services.cluster import join
from services.cluster import serve as serve_cli
from services.cluster.cli_cluster import ADDRESS_HELP

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ray-address", help=ADDRESS_HELP)
    parser.add_argument("--host", help="address to bind (default: the cluster config's)")
    parser.add_argument("--port", type=int, help="port to bind (default: the cluster config's)")
    parser.add_argument(
        "--api-key-file", help="require the bearer key in this file (default: $BATON_API_KEY)"
    )
    parser.add_argument("--api-keys-file", help="key names -> salted hashes and limits")
    parser.add_argument("--policy", help="router policy of this gateway")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    ray_address = join.ray_address(args.ray_address, os.environ)
    import ray

    from services.cluster.control_plane import NAMESPACE, find_control_plane
    from services.engine.messages import EngineError

    if not join.join(ray_address, "baton gateway", NAMESPACE):
        return 1
    plane = find_control_plane()
    if plane is None:
        print("baton gateway: no control plane here; run `baton cluster up`", file=sys.stderr)
        return 1
    try:
        config = ray.get(plane.cluster_config.remote()).with_overrides(
            {
                "gateway.host": args.host,
                "gateway.port": args.port,
                "gateway.api_key": serve_cli.api_key(args.api_key_file, dict(os.environ)),
                "gateway.api_keys_file": args.api_keys_file,
                "router.policy": args.policy,
            }
        )
        serve_cli.check_backend_options(config)
        serve_cli.check_model_here(config)
    except (ValueError, KeyError, OSError, EngineError) as e:
        print(f"baton gateway: invalid configuration: {e}", file=sys.stderr)
        return 2
    return asyncio.run(
        serve_cli.serve(
            config, log_level=args.log_level, ray_address=ray_address, gateway_only=True
        )
    )
