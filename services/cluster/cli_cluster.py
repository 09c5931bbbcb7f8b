"""``baton cluster up|down``: the control plane (controller + workers) as detached Ray actors.

    ray start --head                                   # or a KubeRay head
    baton cluster up --ray-address ADDR --config deploy/configs/local.yaml [--prefill 2 ...]
    baton gateway --ray-address ADDR --port 8000       # as many as you like, any time
    baton cluster down --ray-address ADDR

``up`` returns once every worker has sent telemetry; the actors outlive it and
every gateway. It takes ``baton serve``'s flags (the gateway ones only set the
defaults that ``baton gateway`` starts from).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from services.cluster import serve as serve_cli

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    up = sub.add_parser("up", help="start the controller and the workers; wait until ready")
    serve_cli.add_arguments(up)
    down = sub.add_parser("down", help="stop every worker and the controller")
    down.add_argument("--ray-address", help="the Ray cluster (default: $RAY_ADDRESS)")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    ray_address = args.ray_address or os.environ.get("RAY_ADDRESS")
    if not ray_address:
        print("baton cluster: --ray-address (or RAY_ADDRESS) is required", file=sys.stderr)
        return 2
    import ray

    from services.cluster.control_plane import (
        NAMESPACE,
        find_control_plane,
        start_control_plane,
    )

    if args.action == "up":
        try:
            config = serve_cli.build_config(args)
            serve_cli.check_backend_options(config)
        except (ValueError, KeyError, OSError) as e:
            print(f"baton cluster up: invalid configuration: {e}", file=sys.stderr)
            return 2
        ray.init(address=ray_address, namespace=NAMESPACE, log_to_driver=False)
        registry = ray.get(start_control_plane(config).start.remote())
        ids = ", ".join(f"{w.worker_id} ({w.role.value})" for w in registry.workers)
        print(f"Baton control plane is up: {ids}", flush=True)
        return 0
    ray.init(address=ray_address, namespace=NAMESPACE, log_to_driver=False)
    plane = find_control_plane()
    if plane is None:
        print("baton cluster down: no control plane is running", file=sys.stderr)
        return 1
    ray.get(plane.shutdown.remote())
    ray.kill(plane, no_restart=True)
    print("Baton control plane is down", flush=True)
    return 0
