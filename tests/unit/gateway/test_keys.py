"""API keys stored as salted hashes; a token's key found by comparing every hash."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.gateway import keys as keys_module
from services.gateway.keys import KeyLimits, KeyTable, hash_key, load_key_table, new_key


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_a_key_file_holds_names_hashes_and_limits_never_keys(tmp_path: Path) -> None:
    alice, bob = new_key(), new_key()
    path = _write(
        tmp_path / "keys.yaml",
        f"alice: {{hash: '{hash_key(alice)}', requests_per_minute: 60, tokens_per_minute: 1000}}\n"
        f"bob: {{hash: '{hash_key(bob)}', max_concurrent_requests: 2}}\n",
    )
    assert alice not in path.read_text() and bob not in path.read_text()
    table = load_key_table(path)
    found_alice, found_bob = table.find(alice.encode()), table.find(bob.encode())
    assert found_alice is not None and found_alice.name == "alice"
    assert found_alice.limits == KeyLimits(requests_per_minute=60, tokens_per_minute=1000)
    assert found_bob is not None and found_bob.limits == KeyLimits(max_concurrent_requests=2)
    assert table.find(b"sk-baton-wrong") is None
    assert table.find(alice[:-1].encode()) is None


def test_equal_keys_have_different_hashes() -> None:
    key = new_key()
    assert hash_key(key) != hash_key(key)
    assert hash_key(key, salt=b"s" * 16) == hash_key(key, salt=b"s" * 16)


@pytest.mark.parametrize("which", ["first", "last", "wrong"])
def test_every_entry_is_compared_whichever_key_is_given(
    which: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Constant time: as many hash comparisons for the first key, the last and a wrong one."""
    names = [f"k{i}" for i in range(5)]
    plain = {name: new_key() for name in names}
    table = KeyTable.from_mapping({n: {"hash": hash_key(k)} for n, k in plain.items()})
    calls: list[int] = []
    real = keys_module.hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(keys_module.hmac, "compare_digest", counting)
    token = {"first": plain["k0"], "last": plain["k4"], "wrong": "sk-baton-nope"}[which]
    found = table.find(token.encode())
    assert (found.name if found else None) == {"first": "k0", "last": "k4", "wrong": None}[which]
    assert len(calls) == len(names)


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("alice: {hash: 'md5$00$11'}", "hash"),
        ("alice: {hash: 'hmac-sha256$zz$11'}", "hash"),
        ("alice: {hash: 'HASH', requests_per_minute: 0}", "requests_per_minute"),
        ("alice: {hash: 'HASH', tokens_per_minute: true}", "tokens_per_minute"),
        ("alice: {hash: 'HASH', rpm: 5}", "rpm"),
        ("'bad name': {hash: 'HASH'}", "name"),
        ("- alice", "mapping"),
    ],
)
def test_bad_entries_are_refused_naming_the_field(tmp_path: Path, text: str, named: str) -> None:
    stored = hash_key(new_key())
    path = _write(tmp_path / "keys.yaml", text.replace("HASH", stored))
    with pytest.raises(ValueError, match=named) as info:
        load_key_table(path)
    assert stored not in str(info.value)  # errors never echo a hash


def test_single_key_is_held_only_hashed() -> None:
    table = KeyTable.single("sekret")
    (entry,) = table.entries
    assert entry.name == "default" and b"sekret" not in entry.digest + entry.salt
    assert table.find(b"sekret") is entry and table.find(b"sekre") is None
