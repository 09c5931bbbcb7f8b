"""``baton keys add`` writes only salted hashes; ``baton serve --api-keys-file`` reads them."""

from __future__ import annotations

import io
import stat
from pathlib import Path

import pytest

from services.cli import main
from services.cluster.serve import build_config, check_backend_options
from services.gateway.keys import KeyLimits, load_key_table
from tests.unit.gateway.test_serve_config import parse


def test_keys_add_prints_the_key_once_and_stores_its_hash(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "keys.yaml"
    assert main(["keys", "add", "alice", "--file", str(path), "--requests-per-minute", "5"]) == 0
    key = capsys.readouterr().out.strip()
    assert key.startswith("sk-baton-") and key not in path.read_text()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    monkeypatch.setattr("sys.stdin", io.StringIO("my-own-key\n"))
    assert main(["keys", "add", "bob", "--file", str(path), "--stdin"]) == 0
    assert capsys.readouterr().out == ""  # a key from stdin is not echoed
    table = load_key_table(path)
    alice, bob = table.find(key.encode()), table.find(b"my-own-key")
    assert alice is not None and alice.limits == KeyLimits(requests_per_minute=5)
    assert bob is not None and bob.name == "bob"
    assert main(["keys", "add", "alice", "--file", str(path)]) == 2  # names are unique
    assert main(["keys", "add", "carol", "--file", str(path), "--tokens-per-minute", "0"]) == 2


def test_serve_reads_the_key_file_and_refuses_a_bad_one_before_starting(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text("alice: {hash: 'not-a-hash'}\n")
    config = build_config(parse("--api-keys-file", str(path)), {})
    assert config.gateway.api_keys_file == str(path)
    with pytest.raises(ValueError, match="alice"):
        check_backend_options(config)
    missing = build_config(parse("--api-keys-file", str(tmp_path / "nope.yaml")), {})
    with pytest.raises(OSError):
        check_backend_options(missing)


def test_keys_list_shows_names_and_limits_never_hashes_and_remove_revokes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "keys.yaml"
    assert main(["keys", "add", "alice", "--file", str(path), "--requests-per-minute", "5"]) == 0
    assert main(["keys", "add", "bob", "--file", str(path)]) == 0
    capsys.readouterr()
    assert main(["keys", "list", "--file", str(path)]) == 0
    listed = capsys.readouterr().out
    assert listed.splitlines() == ["alice  requests-per-minute=5", "bob  (no limits)"]
    assert main(["keys", "remove", "carol", "--file", str(path)]) == 2
    assert "no key named 'carol' (it has: alice, bob)" in capsys.readouterr().err
    assert main(["keys", "remove", "bob", "--file", str(path)]) == 0
    assert [e.name for e in load_key_table(path).entries] == ["alice"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert main(["keys", "list", "--file", str(tmp_path / "nope.yaml")]) == 2


def test_serve_refuses_a_key_file_with_no_keys(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text("{}\n")
    with pytest.raises(ValueError, match="no keys; every request would be refused"):
        check_backend_options(build_config(parse("--api-keys-file", str(path)), {}))


def test_a_key_file_that_is_not_yaml_is_refused_by_place_never_by_its_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text("alice: {hash: 'hmac-sha256$00$11', requests_per_minute: [5\n")
    with pytest.raises(ValueError, match="not valid YAML at line 2, column 1") as e:
        check_backend_options(build_config(parse("--api-keys-file", str(path)), {}))
    assert "hmac" not in str(e.value)
    assert main(["keys", "list", "--file", str(path)]) == 2
    err = capsys.readouterr().err
    assert "not valid YAML at line 2" in err and "hmac" not in err
