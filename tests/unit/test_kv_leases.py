"""LeaseTable and make_connector rules, with an injected clock (no sleeping)."""

from __future__ import annotations

import pytest
import torch

from kvtransfer import (
    KVLayout,
    LayoutMismatchError,
    TransferState,
    UnknownHandleError,
    available_backends,
    make_connector,
)
from kvtransfer.leases import LeaseTable


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def recorder() -> tuple[list[list[int]], object]:
    calls: list[list[int]] = []
    return calls, lambda ids: calls.append(list(ids))


def test_release_is_idempotent_and_fires_once() -> None:
    table = LeaseTable(FakeClock())
    calls, cb = recorder()
    hold = table.add("kv", [3, 1], 30.0, cb)  # type: ignore[arg-type]
    assert table.release(hold.transfer_id) is True
    assert table.release(hold.transfer_id) is False
    table.collect()
    assert calls == [[3, 1]]
    assert table.get(hold.transfer_id) is None and len(table) == 0


def test_lease_expires_only_after_its_deadline() -> None:
    clock = FakeClock()
    table = LeaseTable(clock)
    calls, cb = recorder()
    hold = table.add("kv", [7], 5.0, cb)  # type: ignore[arg-type]
    clock.now_s += 4.9
    assert table.collect() == [] and calls == []
    clock.now_s += 0.2
    assert [h.transfer_id for h in table.collect()] == [hold.transfer_id]
    assert calls == [[7]]
    assert table.pin(hold.transfer_id) is None


def test_pinned_hold_defers_expiry_and_release_until_unpinned() -> None:
    clock = FakeClock()
    table = LeaseTable(clock)
    calls, cb = recorder()
    hold = table.add("kv", [1, 2], 1.0, cb)  # type: ignore[arg-type]
    assert table.pin(hold.transfer_id) is hold
    clock.now_s += 10.0
    table.release(hold.transfer_id)
    table.collect()
    assert calls == []  # bytes are still being sent from these blocks
    assert table.pin(hold.transfer_id) is None  # but no new pull may start
    table.unpin(hold.transfer_id)
    table.collect()
    assert calls == [[1, 2]]


def test_backend_hook_runs_before_the_holder_callback() -> None:
    order: list[str] = []
    table = LeaseTable(FakeClock(), on_free=lambda h: order.append("hook"))
    hold = table.add("kv", [0], 1.0, lambda ids: order.append("callback"))
    table.release(hold.transfer_id)
    assert order == ["hook", "callback"]


LAYOUT = KVLayout(num_layers=1, block_size=2, num_kv_heads=1, head_dim=4, dtype="float32")


def test_local_expiry_uses_the_injected_clock() -> None:
    clock = FakeClock()
    holder = make_connector("local", lease_s=2.0, clock=clock)
    puller = make_connector("local", clock=clock)
    pool = torch.arange(4 * 16, dtype=torch.float32).view(4, *LAYOUT.block_shape)
    holder.register("kv", pool, LAYOUT)
    puller.register("kv", torch.zeros_like(pool), LAYOUT)
    calls, cb = recorder()
    handle = holder.hold("kv", [2], on_release=cb)  # type: ignore[arg-type]
    assert handle.expires_at_s == pytest.approx(102.0)
    holder.progress()
    assert calls == []
    clock.now_s += 2.5
    holder.progress()
    assert calls == [[2]]
    with pytest.raises(UnknownHandleError):
        puller.pull(handle, "kv", [0])


def test_region_and_pull_arguments_are_checked() -> None:
    conn = make_connector("local")
    with pytest.raises(ValueError, match="shape"):
        conn.register("kv", torch.zeros(4, 3), LAYOUT)
    with pytest.raises(ValueError, match="dtype"):
        conn.register("kv", torch.zeros((4, *LAYOUT.block_shape), dtype=torch.float16), LAYOUT)
    conn.register("kv", torch.zeros((4, *LAYOUT.block_shape)), LAYOUT)
    with pytest.raises(ValueError, match="out of range"):
        conn.hold("kv", [4])
    with pytest.raises(ValueError, match="duplicate"):
        conn.hold("kv", [1, 1])
    handle = conn.hold("kv", [1, 2])
    with pytest.raises(ValueError, match="2 held blocks"):
        conn.pull(handle, "kv", [0])
    with pytest.raises(UnknownHandleError):
        conn.poll("never-pulled")


def test_layout_mismatch_names_each_field() -> None:
    other = KVLayout(num_layers=2, block_size=4, num_kv_heads=1, head_dim=4, dtype="float32")
    with pytest.raises(LayoutMismatchError) as err:
        LAYOUT.check_compatible(other)
    assert "num_layers" in str(err.value) and "block_size" in str(err.value)
    assert "head_dim" not in str(err.value)


def test_registry() -> None:
    assert "local" in available_backends()
    with pytest.raises(ValueError, match="unknown KV backend"):
        make_connector("carrier-pigeon")
    conn = make_connector("local", agent_name="p0")
    assert conn.name == "local" and conn.agent_name == "p0"
    assert TransferState.DONE.is_final and not TransferState.TRANSFERRING.is_final
