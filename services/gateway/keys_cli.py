"""``baton keys``: make, list and remove API keys; a key file stores only salted hashes.

    baton keys add alice --file keys.yaml [--requests-per-minute 60] [--tokens-per-minute N]
        [--max-concurrent-requests N] [--stdin]
    baton keys list --file keys.yaml
    baton keys remove alice --file keys.yaml

``add`` prints the new key once, on stdout (``--stdin``: hash the key read from stdin
instead); the file gets ``alice: {hash: ..., limits}`` and is kept private (0600).
``list`` prints each key's name and limits (never a hash). ``remove`` revokes a key:
a gateway serving with the file reads it again within a second and refuses the key
from then on, no restart (``services.gateway.access.KeyFile``). Rotating a key is an
``add`` of its successor, then a ``remove`` once clients have moved.
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

from services.gateway.keys import KeyTable, hash_key, new_key, read_key_file

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    listing = sub.add_parser("list", help="each key's name and limits (never a hash)")
    listing.add_argument("--file", required=True, help="the key file")
    remove = sub.add_parser("remove", help="revoke a key: serving gateways refuse it within 1 s")
    remove.add_argument("name", help="the key's name")
    remove.add_argument("--file", required=True, help="the key file")
    add = sub.add_parser("add", help="make a key (or hash one from stdin) and store its hash")
    add.add_argument("name", help="the key's name: shown in /metrics and errors, never the key")
    add.add_argument("--file", required=True, help="the key file to create or extend")
    add.add_argument("--requests-per-minute", type=int)
    add.add_argument("--tokens-per-minute", type=int)
    add.add_argument("--max-concurrent-requests", type=int)
    add.add_argument("--stdin", action="store_true", help="hash the key read from stdin")


def run(args: argparse.Namespace) -> int:
    path = Path(args.file)
    try:
        data = _read(path, must_exist=args.action != "add")
    except (OSError, ValueError) as e:
        print(f"baton keys: {e}", file=sys.stderr)
        return 2
    if args.action == "list":
        return _list(data, path)
    if args.action == "remove":
        return _remove(data, path, args.name)
    return _add(data, path, args)


def _read(path: Path, *, must_exist: bool) -> dict[str, Any]:
    """The key file's mapping, checked as the gateway checks it (a ValueError naming
    the problem); {} for an ``add`` to a file not made yet."""
    if not path.exists() and not must_exist:
        return {}
    data = read_key_file(path)
    KeyTable.from_mapping(data, str(path))  # what the gateway refuses, by the same words
    return data


def _list(data: dict[str, Any], path: Path) -> int:
    table = KeyTable.from_mapping(data, str(path))
    for entry in table.entries:
        limits = [
            f"{field.replace('_', '-')}={value}"
            for field, value in (
                ("requests_per_minute", entry.limits.requests_per_minute),
                ("tokens_per_minute", entry.limits.tokens_per_minute),
                ("max_concurrent_requests", entry.limits.max_concurrent_requests),
            )
            if value is not None
        ]
        print(entry.name + ("  " + " ".join(limits) if limits else "  (no limits)"))
    return 0


def _remove(data: dict[str, Any], path: Path, name: str) -> int:
    if name not in data:
        have = ", ".join(sorted(data)) or "none"
        print(f"baton keys: {path} has no key named {name!r} (it has: {have})", file=sys.stderr)
        return 2
    del data[name]
    _write(path, data)
    if not data:
        print(
            f"baton keys: {path} has no key left: a gateway serving it refuses every request",
            file=sys.stderr,
        )
    return 0


def _write(path: Path, data: dict[str, Any]) -> None:
    """Replace the file at once (a gateway reading it meanwhile sees the old or the new
    whole, never half), private (0600)."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        yaml.safe_dump(data, f, sort_keys=True)
    os.replace(tmp, path)


def _add(data: dict[str, Any], path: Path, args: argparse.Namespace) -> int:
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
    _write(path, data)
    if not args.stdin:
        print(key)
    return 0
