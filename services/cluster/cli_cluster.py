"""``baton cluster up|down``: the control plane (controller + workers) as detached Ray actors.

    ray start --head                                   # or a KubeRay head
    baton cluster up --config deploy/configs/local.yaml [--prefill 2 ...]
    baton gateway --port 8000                          # as many as you like, any time
    baton cluster down

Each joins ``--ray-address``, else ``$RAY_ADDRESS``, else the Ray cluster running on
this machine (``services.cluster.join``). ``up`` returns once every worker has sent
telemetry; the actors outlive it and every gateway. It takes ``baton serve``'s flags
(the gateway ones only set the defaults that ``baton gateway`` starts from). A plane
already running is left as it is: ``up`` says so, and if it was started with another
configuration, names what differs and exits 1 (``baton cluster down`` first).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from services.cluster import join
from services.cluster import serve as serve_cli

__all__ = ["ADDRESS_HELP", "add_arguments", "run"]

ADDRESS_HELP = "the Ray cluster (default: $RAY_ADDRESS, else the one running on this machine)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    up = sub.add_parser("up", help="start the controller and the workers; wait until ready")
    serve_cli.add_arguments(up, ray_address_help=ADDRESS_HELP)
    down = sub.add_parser("down", help="stop every worker and the controller")
    down.add_argument("--ray-address", help=ADDRESS_HELP)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    ray_address = join.ray_address(args.ray_address, os.environ)
    from services.cluster.control_plane import (
        NAMESPACE,
        find_control_plane,
        start_control_plane,
    )

    command = f"baton cluster {args.action}"
    if args.action == "up":
        try:
            config = serve_cli.build_config(args)
            serve_cli.check_backend_options(config)
        except (ValueError, KeyError, OSError) as e:
            print(f"{command}: invalid configuration: {e}", file=sys.stderr)
            return 2
        if not join.join(ray_address, command, NAMESPACE):
            return 1
        import ray

        running = find_control_plane()
        if running is not None:
            differences = ray.get(running.cluster_config.remote()).differences(config)
            if differences:
                print(
                    f"{command}: a control plane is already running with another "
                    f"configuration (running, asked): {'; '.join(differences)}. "
                    "Run `baton cluster down` first to start it anew",
                    file=sys.stderr,
                )
                return 1
        registry = ray.get(start_control_plane(config).start.remote())
        ids = ", ".join(f"{w.worker_id} ({w.role.value})" for w in registry.workers)
        state = "already up" if running is not None else "up"
        print(f"Baton control plane is {state}: {ids}", flush=True)
        return 0
    if not join.join(ray_address, command, NAMESPACE):
        return 1
    import ray

    plane = find_control_plane()
    if plane is None:
        print(f"{command}: no control plane is running", file=sys.stderr)
        return 1
    ray.get(plane.shutdown.remote())
    ray.kill(plane, no_restart=True)
    print("Baton control plane is down", flush=True)
    return 0
