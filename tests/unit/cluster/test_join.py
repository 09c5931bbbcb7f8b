"""Joining the Ray cluster for ``baton cluster`` and ``baton gateway``: which address, and
what a failure says (a ``ray start`` cluster uses token authentication, which Ray sends
to an explicit address only with RAY_AUTH_MODE=token; without it, Ray's own error names
no cause)."""

from __future__ import annotations

from pathlib import Path

from services.cluster.join import AUTO, join_failure, ray_address
from services.config import ClusterConfig


def test_the_address_is_the_flag_else_the_environment_else_this_machines_cluster() -> None:
    assert ray_address("10.0.0.1:6379", {"RAY_ADDRESS": "10.0.0.2:6379"}) == "10.0.0.1:6379"
    assert ray_address(None, {"RAY_ADDRESS": "10.0.0.2:6379"}) == "10.0.0.2:6379"
    assert ray_address(None, {}) == AUTO


def test_no_cluster_on_this_machine_says_how_to_start_or_name_one(tmp_path: Path) -> None:
    error = "Could not find any running Ray instance. Please specify the one to connect to"
    said = join_failure(AUTO, error, {}, tmp_path)
    assert "no Ray cluster is running on this machine" in said
    assert "`ray start --head`" in said and "--ray-address" in said
    # One found that would not have us is not 'none running': Ray's reason is kept.
    refused = "Failed to connect to Ray cluster at 192.0.2.2:6379"
    said = join_failure(AUTO, refused, {}, tmp_path)
    assert said == f"cannot join this machine's Ray cluster ({refused})"


def test_an_explicit_address_with_a_token_at_hand_names_ray_auth_mode(tmp_path: Path) -> None:
    error = "Failed to connect to Ray cluster at 192.0.2.2:6379"
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("t" * 64)
    said = join_failure("127.0.0.1:6379", error, {}, tmp_path)
    assert said.startswith(f"cannot join the Ray cluster at 127.0.0.1:6379 ({error})")
    assert "RAY_AUTH_MODE=token" in said
    # A token in the environment, or in the file RAY_AUTH_TOKEN_PATH names, counts too.
    elsewhere = tmp_path / "token"
    elsewhere.write_text("t" * 64)
    assert "RAY_AUTH_MODE" in join_failure("h:1", error, {"RAY_AUTH_TOKEN": "x"}, Path("/no"))
    path_env = {"RAY_AUTH_TOKEN_PATH": str(elsewhere)}
    assert "RAY_AUTH_MODE" in join_failure("h:1", error, path_env, Path("/no"))


def test_no_token_hint_where_the_mode_is_set_or_no_token_exists(tmp_path: Path) -> None:
    error = "Failed to connect to Ray cluster at 10.0.0.9:6379"
    assert "RAY_AUTH_MODE" not in join_failure("10.0.0.9:6379", error, {}, tmp_path)
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("t" * 64)
    set_mode = {"RAY_AUTH_MODE": "token"}
    assert "RAY_AUTH_MODE" not in join_failure("10.0.0.9:6379", error, set_mode, tmp_path)


def test_config_differences_name_each_dotted_key_and_hide_secrets() -> None:
    running = ClusterConfig().with_overrides({"workers.prefill": 1, "gateway.api_key": "old"})
    asked = running.with_overrides(
        {"workers.prefill": 2, "router.policy": "round_robin", "gateway.api_key": "new"}
    )
    assert running.differences(running) == []
    said = running.differences(asked)
    assert "workers.prefill: 1, 2" in said
    assert f"router.policy: {running.router.policy!r}, 'round_robin'" in said
    assert "gateway.api_key: differs" in said
    assert not any("old" in line or "new" in line for line in said)
    assert len(said) == 3
