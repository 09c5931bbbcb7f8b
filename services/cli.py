"""The one CLI, ``baton``: parses, builds a config, calls a function.

Each subcommand's flags live beside the code it runs (``add_parser(subparsers)``
in the owning module), imported only when that subcommand is used, so
``baton bench`` does not pay for importing Ray and torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["main"]

# subcommand -> "module:function" that adds its parser and sets ``func``.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("services.cluster.serve", "start the cluster and the OpenAI-compatible gateway"),
    "cluster": (
        "services.cluster.cli_cluster",
        "start or stop a control plane that outlives gateways",
    ),
    "gateway": ("services.cluster.cli_gateway", "one more gateway over a running control plane"),
    "bench": ("loadgen.cli_bench", "load-test a running server and write a goodput report"),
    "simulate": ("loadgen.sim.cli", "simulate a cluster driving the real router"),
    "profile": ("loadgen.cli_profile", "measure a running worker's prefill and decode curves"),
    "plan": ("router.cli_plan", "size prefill and decode pools for a target rate"),
    "keys": ("services.gateway.keys_cli", "make API keys and store their salted hashes"),
}


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="baton", description="Disaggregated LLM serving.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    parser.add_argument("--version", action="version", version=f"baton {_version()}")
    if args_list[:1] == ["--version"]:
        parser.parse_args(args_list[:1])  # prints it and exits 0
    if not args_list or args_list[0] not in SUBCOMMANDS:
        parser.print_help()
        return 0 if not args_list or args_list[0] in ("-h", "--help") else 2
    name = args_list[0]
    module = importlib.import_module(SUBCOMMANDS[name][0])
    # No prefix matching: a retired flag (--api-key) must fail, not match --api-key-file.
    sub_parser = argparse.ArgumentParser(
        prog=f"baton {name}", description=SUBCOMMANDS[name][1], allow_abbrev=False
    )
    module.add_arguments(sub_parser)
    args = sub_parser.parse_args(args_list[1:])
    result: int | None = module.run(args)
    return int(result or 0)


def _version() -> str:
    """The installed package's version (a source tree run without installing: unknown)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("baton")
    except PackageNotFoundError:
        return "unknown (not installed)"


if __name__ == "__main__":
    sys.exit(main())
