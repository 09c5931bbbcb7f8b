"""``baton keys add``: make an API key and store only its salted hash in a key file.

    baton keys add alice --file keys.yaml [--requests-per-minute 60] [--tokens-per-minute N]
        [--max-concurrent-requests N] [--stdin]

Prints the new key once, on stdout (``--stdin``: hash the key read from stdin
instead); the file gets ``alice: {hash: ..., limits}`` and is kept private (0600).
Serve with ``baton serve --api-keys-file keys.yaml``; on Kubernetes, put the file in
the Secret named by the chart's ``apiKeys.existingSecret``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from services.gateway.keys import KeyTable, hash_key, new_key

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    add = sub.add_parser("add", help="make a key (or hash one from stdin) and store its hash")
    add.add_argument("name", help="the key's name: shown in /metrics and errors, never the key")
    add.add_argument("--file", required=True, help="the key file to create or extend")
    add.add_argument("--requests-per-minute", type=int)
    add.add_argument("--tokens-per-minute", type=int)
    add.add_argument("--max-concurrent-requests", type=int)
    add.add_argument("--stdin", action="store_true", help="hash the key read from stdin")


def run(args: argparse.Namespace) -> int:
    path = Path(args.file)
    data: dict[str, Any] = {}
    if path.exists():
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    if args.name in data:
        print(f"baton keys: {path} already has a key named {args.name!r}", file=sys.stderr)
        return 2
    key = sys.stdin.readline().strip() if args.stdin else new_key()
    if not key:
        print("baton keys: no key on stdin", file=sys.stderr)
        return 2
    entry: dict[str, Any] = {"hash": hash_key(key)}
    for field in ("requests_per_minute", "tokens_per_minute", "max_concurrent_requests"):
        if getattr(args, field) is not None:
            entry[field] = getattr(args, field)
    data[args.name] = entry
    try:
        KeyTable.from_mapping(data, str(path))  # refuse what the gateway would refuse
    except ValueError as e:
        print(f"baton keys: {e}", file=sys.stderr)
        return 2
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        yaml.safe_dump(data, f, sort_keys=True)
    if not args.stdin:
        print(key)
    return 0
