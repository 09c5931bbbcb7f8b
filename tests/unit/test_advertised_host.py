"""The address KV peers are told to reach a worker at."""

from __future__ import annotations

import pytest

from kvtransfer.net import advertised_host


def test_the_pods_ip_from_the_chart_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BATON_NODE_IP", raising=False)
    monkeypatch.setenv("BATON_POD_IP", "10.1.2.3")
    assert advertised_host() == "10.1.2.3"
    monkeypatch.setenv("BATON_NODE_IP", "10.9.9.9")
    assert advertised_host() == "10.9.9.9"


def test_without_hints_it_is_a_routable_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BATON_NODE_IP", raising=False)
    monkeypatch.delenv("BATON_POD_IP", raising=False)
    host = advertised_host()
    parts = host.split(".")
    assert len(parts) == 4 and all(0 <= int(p) <= 255 for p in parts)
