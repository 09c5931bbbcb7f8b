"""API keys as salted hashes: the key table, and finding a bearer token's key in constant time.

A key file (a Kubernetes Secret mounted as a file, or any YAML/JSON file) maps each
key's NAME to its salted hash and optional limits; the keys themselves are never
stored, logged or put in metrics:

    alice:
      hash: "hmac-sha256$<salt hex>$<digest hex>"
      requests_per_minute: 60          # optional, each
      tokens_per_minute: 100000
      max_concurrent_requests: 4
    batch-jobs:
      hash: "hmac-sha256$..."

``baton keys add NAME --file keys.yaml`` makes a key and writes its entry.

Why HMAC-SHA256 and not a slow password hash: the hash is computed for every request
against every entry, and API keys are long random strings (``new_key`` gives 256 bits),
so a fast hash leaves nothing to brute-force; the per-key salt keeps equal keys from
having equal hashes. ``KeyTable.find`` hashes the token once per entry and compares
every digest with ``hmac.compare_digest``, never stopping early, so the time it takes
does not depend on which key matched, or whether any did.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from services.config import yaml_error_where

__all__ = [
    "KeyEntry",
    "KeyLimits",
    "KeyTable",
    "hash_key",
    "load_key_table",
    "new_key",
    "read_key_file",
]

_SCHEME = "hmac-sha256"
_SALT_BYTES = 16
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_LIMIT_FIELDS = ("requests_per_minute", "tokens_per_minute", "max_concurrent_requests")


@dataclass(frozen=True, slots=True)
class KeyLimits:
    """None: no limit of that kind."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None


@dataclass(frozen=True, slots=True)
class KeyEntry:
    name: str
    salt: bytes
    digest: bytes
    limits: KeyLimits = KeyLimits()

    def matches(self, token: bytes) -> bool:
        return hmac.compare_digest(_digest(self.salt, token), self.digest)


def new_key() -> str:
    """A fresh random API key (256 bits)."""
    return "sk-baton-" + secrets.token_urlsafe(32)


def hash_key(key: str, salt: bytes | None = None) -> str:
    """The stored form of ``key``: ``hmac-sha256$<salt hex>$<digest hex>``."""
    salt = secrets.token_bytes(_SALT_BYTES) if salt is None else salt
    return f"{_SCHEME}${salt.hex()}${_digest(salt, key.encode()).hex()}"


def _digest(salt: bytes, token: bytes) -> bytes:
    return hmac.new(salt, token, hashlib.sha256).digest()


class KeyTable:
    """The keys a gateway accepts; empty means no key is required, unless ``closed``
    (a key file whose keys were all removed: every request is refused)."""

    def __init__(self, entries: tuple[KeyEntry, ...] = (), *, closed: bool = False) -> None:
        names = [e.name for e in entries]
        if len(set(names)) != len(names):
            raise ValueError("key names must be unique")
        self.entries = entries
        self.closed = closed

    @property
    def is_open(self) -> bool:
        return not self.entries and not self.closed

    def find(self, token: bytes) -> KeyEntry | None:
        """The entry whose key is ``token``: every entry is hashed and compared, whatever matches."""
        found: KeyEntry | None = None
        for entry in self.entries:
            if entry.matches(token) and found is None:
                found = entry
        return found

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str = "key file") -> KeyTable:
        return cls(tuple(_parse_entry(name, spec, source) for name, spec in data.items()))

    @classmethod
    def single(cls, key: str, name: str = "default") -> KeyTable:
        """One key without limits (``gateway.api_key``), hashed here so it is held only hashed."""
        salt = secrets.token_bytes(_SALT_BYTES)
        return cls((KeyEntry(name, salt, _digest(salt, key.encode())),))


def load_key_table(path: str | Path) -> KeyTable:
    """Read a key file (YAML or JSON). Errors name the entry and field, never a hash."""
    return KeyTable.from_mapping(read_key_file(path), str(path))


def read_key_file(path: str | Path) -> dict[str, Any]:
    """A key file's mapping of names to entries, as read (``load_key_table`` checks the
    entries); a ValueError for a file that is not YAML, or not a mapping."""
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML{yaml_error_where(e)}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of key names to entries")
    return data


def _parse_entry(name: Any, spec: Any, source: str) -> KeyEntry:
    where = f"{source}: key {name!r}"
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"{where}: a name is 1-63 letters, digits, '_', '.', '-'")
    if not isinstance(spec, dict):
        raise ValueError(f"{where}: expected a mapping with 'hash'")
    unknown = set(spec) - {"hash", *_LIMIT_FIELDS}
    if unknown:
        raise ValueError(f"{where}: unknown fields {sorted(unknown)}")
    scheme, _, rest = str(spec.get("hash", "")).partition("$")
    salt_hex, _, digest_hex = rest.partition("$")
    try:
        salt, digest = bytes.fromhex(salt_hex), bytes.fromhex(digest_hex)
    except ValueError:
        salt, digest = b"", b""
    if scheme != _SCHEME or not salt or len(digest) != hashlib.sha256().digest_size:
        raise ValueError(f"{where}: 'hash' must be {_SCHEME}$<salt hex>$<digest hex>")
    limits: dict[str, int | None] = {}
    for field in _LIMIT_FIELDS:
        value = spec.get(field)
        if value is not None and (type(value) is not int or value < 1):
            raise ValueError(f"{where}: {field} must be a positive integer")
        limits[field] = value
    return KeyEntry(name, salt, digest, KeyLimits(**limits))
