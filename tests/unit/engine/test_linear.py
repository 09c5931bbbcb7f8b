"""CPU linear layers through oneDNN-packed weights: the same products, packed once."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.engine.linear import (
    MIN_PACKED_ELEMENTS,
    GatedLinear,
    can_pack,
    linear,
    linear_add,
    pack_linears,
    silu_mul,
)


def test_a_packed_layer_computes_f_linear_for_any_number_of_rows() -> None:
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(64, 96, bias=True), nn.Linear(96, 32, bias=False))
    if not can_pack(layers):
        pytest.skip("this torch has no oneDNN packed linear")
    assert pack_linears(layers, batch_size_hint=16, min_elements=0) == 2
    for layer in layers:
        assert isinstance(layer, nn.Linear) and "packed_weight" in layer.__dict__
    for num_rows in (1, 5, 16, 300):
        x = torch.randn(num_rows, 64)
        want = F.linear(x, layers[0].weight, layers[0].bias)
        torch.testing.assert_close(linear(x, layers[0]), want, rtol=1e-5, atol=1e-4)
    assert "packed_weight" not in layers.state_dict()  # checkpoints are unchanged


def test_an_unpacked_layer_is_plain_f_linear() -> None:
    layer = nn.Linear(8, 4)
    x = torch.randn(3, 8)
    assert torch.equal(linear(x, layer), F.linear(x, layer.weight, layer.bias))


def test_only_float32_cpu_models_are_packed() -> None:
    assert not can_pack(nn.Linear(8, 4).to(torch.bfloat16))


def test_small_layers_stay_plain_by_default() -> None:
    """A packed call's fixed cost outweighs a small layer's arithmetic: only large ones pack."""
    layers = nn.Sequential(nn.Linear(64, 64), nn.Linear(512, 512))
    if not can_pack(layers):
        pytest.skip("this torch has no oneDNN packed linear")
    assert MIN_PACKED_ELEMENTS == 512 * 512
    assert pack_linears(layers, batch_size_hint=16) == 1
    assert "packed_weight" not in layers[0].__dict__
    assert "packed_weight" in layers[1].__dict__


def test_the_engine_packs_only_when_its_config_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.engine import engine as engine_module
    from tests.unit.engine.engine_helpers import make_engine

    def packed(engine: engine_module.LLMEngine) -> list[str]:
        return [n for n, m in engine.model.named_modules() if "packed_weight" in m.__dict__]

    default = make_engine("tiny")
    if not can_pack(default.model):
        pytest.skip("this torch has no oneDNN packed linear")
    assert packed(default) == []  # every layer of the tiny model is below MIN_PACKED_ELEMENTS
    # Every layer large enough: on by default, off by config.
    monkeypatch.setattr(
        engine_module, "pack_linears", functools.partial(pack_linears, min_elements=0)
    )
    assert "lm_head" in packed(make_engine("tiny"))
    assert packed(make_engine("tiny", packed_linears=False)) == []


def test_fused_residual_and_gated_products_equal_the_plain_ops() -> None:
    """linear_add and silu_mul through packed weights (post-ops fused) compute the same
    values as the unpacked ops, and a gated layer packs as two halves."""
    torch.manual_seed(0)
    proj = nn.Linear(64, 48, bias=True)
    gated = GatedLinear(64, 2 * 40, bias=False)
    model = nn.ModuleList([proj, gated])
    if not can_pack(model):
        pytest.skip("this torch has no oneDNN packed linear")
    for num_rows in (1, 7, 300):
        x, residual = torch.randn(num_rows, 64), torch.randn(num_rows, 48)
        gate, up = F.linear(x, gated.weight).chunk(2, dim=-1)
        want_gated = F.silu(gate) * up
        want_add = residual + F.linear(x, proj.weight, proj.bias)
        torch.testing.assert_close(silu_mul(x, gated), want_gated)  # unpacked path
        torch.testing.assert_close(linear_add(x, proj, residual), want_add)
        assert pack_linears(model, batch_size_hint=16, min_elements=0) == 2
        assert "packed_halves" in gated.__dict__ and "packed_weight" not in gated.__dict__
        torch.testing.assert_close(silu_mul(x, gated), want_gated, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(linear_add(x, proj, residual), want_add, rtol=1e-5, atol=1e-5)
        for m in model:
            m.__dict__.pop("packed_halves", None)
            m.__dict__.pop("packed_weight", None)
