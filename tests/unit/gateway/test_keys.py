"""API keys stored as salted hashes; a token's key found by comparing every hash."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


# -- the gateway's key file, read again when it changes -------------------------------

_ALICE, _BOB = "sk-baton-alice-0123456789", "sk-baton-bob-9876543210"


class _Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def _key_file(tmp_path: Path, text: str) -> Any:
    from services.config import GatewayConfig
    from services.gateway.access import KeyFile

    path = tmp_path / "keys.yaml"
    path.write_text(text)
    clock = _Clock()
    return path, clock, KeyFile(GatewayConfig(api_keys_file=str(path)), clock=clock)


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name("next.yaml")
    tmp.write_text(text)
    tmp.replace(path)  # a new inode, as `baton keys` and a Secret's update give


def test_the_key_file_is_read_again_only_after_its_interval_and_only_when_it_changed(
    tmp_path: Path,
) -> None:
    path, clock, keys = _key_file(tmp_path, f"alice: {{hash: '{hash_key(_ALICE)}'}}\n")
    first = keys.current()
    assert first.find(_ALICE.encode()) is not None
    _replace(path, f"bob: {{hash: '{hash_key(_BOB)}'}}\n")
    clock.now_s = 0.5
    assert keys.current() is first  # not looked at yet
    clock.now_s = 1.0
    now = keys.current()
    assert now.find(_ALICE.encode()) is None and now.find(_BOB.encode()) is not None
    clock.now_s = 2.5
    assert keys.current() is now  # unchanged file: the same table, not read again


def test_a_key_file_changed_into_a_bad_one_keeps_the_keys_it_had(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path, clock, keys = _key_file(tmp_path, f"alice: {{hash: '{hash_key(_ALICE)}'}}\n")
    for bad in ("alice: {hash: 'not-a-hash'}\n", "alice: [unclosed\n", "- a list\n"):
        _replace(path, bad)
        clock.now_s += 1.0
        assert keys.current().find(_ALICE.encode()) is not None, bad
    path.unlink()
    clock.now_s += 1.0
    assert keys.current().find(_ALICE.encode()) is not None
    assert caplog.text.count("not reloaded, the keys stay as they were") == 4
    assert _ALICE not in caplog.text


def test_a_key_file_emptied_refuses_everyone_it_does_not_open_the_door(tmp_path: Path) -> None:
    path, clock, keys = _key_file(tmp_path, f"alice: {{hash: '{hash_key(_ALICE)}'}}\n")
    _replace(path, "{}\n")
    clock.now_s = 1.0
    table = keys.current()
    assert not table.is_open and table.find(_ALICE.encode()) is None
