"""The C elementwise ops of a CPU decode step (engine/kernels/ops.py: gated, add, add_rms_norm, scale) against
float64 truth and their torch formulations, and the layers that dispatch to them."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from engine import layers
from engine.kernels import cpu, ops

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"CPU kernels unavailable: {cpu.unavailable_reason()}")

KINDS = ("silu", "gelu_tanh")
TORCH = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}
# The accuracy target against float64. Measured over every float32 in [-20, 20] (outside the tests): SiLU within
# 1.5e-7 relative where |act| >= 1e-6; GELU within 4e-7 where |act| >= 0.05 and 1.4e-6 where >= 1e-6 (its negative
# tail: exp(t), t = -2u up to 15 there, passes t's rounding on multiplied by t), 2e-8 absolute below 0.05: at most
# 0.13 of this tolerance.
TRUTH_RTOL, TRUTH_ATOL = 2e-6, 1e-7
# Against torch's float32, measured over [-20, 20] and randn * 3: SiLU within 2.2e-7 relative; GELU within 1.5e-7
# absolute where torch's 0.5 x (1 + tanh(u)) cancels for negative x (torch itself is 4.3e-7 from float64 there)
TORCH_RTOL, TORCH_ATOL = 1e-6, 2e-7


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def truth(kind: str, x: torch.Tensor) -> torch.Tensor:
    """act(x) in float64, each as x / (1 + exp(.)) (no cancellation anywhere)."""
    x = x.double()
    if kind == "silu":
        return x / (1 + torch.exp(-x))
    u = math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)
    return x / (1 + torch.exp(-2 * u))


def assert_near_truth(kind: str, out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> None:
    expected = truth(kind, gate) * up.double()
    err = (out.double() - expected).abs()
    limit = TRUTH_RTOL * expected.abs() + TRUTH_ATOL * up.double().abs()
    assert bool((err <= limit).all()), f"{kind}: worst {(err / limit).max().item():.3g} of the tolerance"


def assert_near_torch(kind: str, out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> None:
    expected = TORCH[kind](gate) * up
    err = (out - expected).abs()
    limit = TORCH_RTOL * expected.abs() + TORCH_ATOL * up.abs()
    assert bool((err <= limit).all()), f"{kind}: worst {(err / limit).max().item():.3g} of the tolerance"


@pytest.mark.parametrize("kind", KINDS)
def test_gated_is_within_its_tolerance_of_float64_and_of_torch_over_minus_20_to_20(kind):
    x = torch.linspace(-20, 20, 7 * 57_143).reshape(7, -1)  # n not a multiple of 8
    ones = torch.ones_like(x)
    out = ops.gated(kind, x, ones)
    assert_near_truth(kind, out, x, ones)
    assert_near_torch(kind, out, x, ones)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", range(1, 9))
def test_gated_of_the_strided_halves_of_a_product(kind, rows):
    n = 2051  # 256 vectors of 8 and a tail of 3
    y = torch.randn(rows, 2 * n, generator=gen(rows)) * 4
    gate, up = y.split([n, n], -1)  # rows 2n apart, as Projections splits gate and up
    out = ops.gated(kind, gate, up)
    assert out.shape == (rows, n) and out.is_contiguous()
    assert torch.equal(out, ops.gated(kind, gate.contiguous(), up.contiguous()))
    assert_near_truth(kind, out, gate, up)
    assert_near_torch(kind, out, gate, up)


@pytest.mark.parametrize("kind", KINDS)
def test_a_gated_value_does_not_depend_on_its_row_or_place(kind):
    """A row alone or among 8 (each of its own), and each value at any offset from a vector's start (the
    vector loop or the scalar tail): the same bits."""
    n = 1003
    y = torch.randn(8, 2 * n, generator=gen(20)) * 5
    gate, up = y.split([n, n], -1)
    together = ops.gated(kind, gate, up)
    for r in range(8):
        assert torch.equal(ops.gated(kind, gate[r : r + 1], up[r : r + 1]), together[r : r + 1])
    for shift in range(1, 9):
        assert torch.equal(ops.gated(kind, gate[:, shift:], up[:, shift:]), together[:, shift:])


@pytest.mark.parametrize("kind", KINDS)
def test_gated_of_large_values_is_finite_with_the_right_limits(kind):
    big = torch.tensor([88.0, 88.5, 88.8, 89.0, 100.0, 1e4, 1e30, 3e38])
    x = torch.cat([big, -big, torch.tensor([0.0, -0.0, 1e-30, -1e-30])])[None].repeat(1, 3)  # a tail and vectors
    out = ops.gated(kind, x, torch.ones_like(x))
    assert bool(torch.isfinite(out).all())
    n = len(big)
    for part in range(3):
        o = out[0, part * (2 * n + 4) :]
        assert torch.equal(o[:n], big)  # act(x) = x for large x
        assert bool((o[n : 2 * n] <= 0).all()) and float(o[n : 2 * n].abs().max()) < 1e-35  # -> -0 for large -x
        small = o[2 * n : 2 * n + 4]  # x / 2
        assert torch.equal(small, torch.tensor([0.0, -0.0, 5e-31, -5e-31])) and small.signbit().tolist() == [
            False, True, False, True]


@pytest.mark.parametrize("kind", KINDS)
def test_a_portable_build_computes_the_same_bits(kind):
    """The scalar code (-DSD_PORTABLE: no AVX2) does the vector code's float operations."""
    x = torch.cat([torch.linspace(-100, 100, 100_003), torch.randn(10_000, generator=gen(40)) * 1e3,
                   torch.tensor([1e30, -1e30, 3e38, -3e38, 0.0, -0.0])])
    up = torch.randn(x.shape, generator=gen(41))
    portable = cpu._open(("-DSD_PORTABLE",))
    out = torch.empty_like(x)
    portable.sd_gated(KINDS.index(kind), x.data_ptr(), 0, up.data_ptr(), 0, out.data_ptr(), 1, x.numel())
    assert torch.equal(out, ops.gated(kind, x[None], up[None])[0])


def test_gated_takes_any_leading_dimensions():
    x = torch.randn(2, 3, 20, generator=gen(30))
    for gate, up in ((x, x * 2), (x[..., :10], x[..., 10:]), (x[0, 0], x[1, 1])):
        out = ops.gated("gelu_tanh", gate, up)
        assert out.shape == gate.shape and out.is_contiguous()
        assert torch.equal(out.flatten(), ops.gated("gelu_tanh", gate.reshape(1, -1), up.reshape(1, -1))[0])


def test_gated_refuses_an_unknown_kind_or_mismatched_shapes():
    x = torch.randn(2, 16, generator=gen(3))
    with pytest.raises(KeyError):
        ops.gated("relu", x, x)
    with pytest.raises(ValueError):
        ops.gated("silu", x, x[:, :8])


@pytest.mark.parametrize("shape", [(1, 640), (5, 2048), (3, 13)])
def test_add_and_scale_are_torch_bits(shape):
    x, r = torch.randn(shape, generator=gen(4)) * 10, torch.randn(shape, generator=gen(5))
    assert torch.equal(ops.add(x, r), x + r)
    for s in (float(torch.tensor(math.sqrt(640), dtype=torch.float32)), 0.1, -3.0):
        assert torch.equal(ops.scale(x, s), x * torch.tensor(s, dtype=torch.float32))


@pytest.mark.parametrize("rows", [1, 4, 8])
def test_add_rms_norm_is_add_then_rms_norm(rows):
    x, r = torch.randn(rows, 640, generator=gen(6)) * 3, torch.randn(rows, 640, generator=gen(7))
    w = torch.randn(640, generator=gen(8))
    total, normed = ops.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(total, x + r)
    assert torch.equal(normed, ops.rms_norm(x + r, w, 1e-6))


def test_layers_take_the_c_ops_for_float32_and_torch_otherwise():
    y = torch.randn(3, 2 * 100, generator=gen(9))
    gate, up = y.split([100, 100], -1)
    assert torch.equal(layers.gelu_mul(gate, up), ops.gated("gelu_tanh", gate, up))
    assert torch.equal(layers.silu_mul(gate, up), ops.gated("silu", gate, up))
    x, r = y[:, :100].contiguous(), y[:, 100:].contiguous()
    assert torch.equal(layers.add(x, r), x + r)
    assert torch.equal(layers.scale(x, 2.5), x * 2.5)
    w = torch.randn(100, generator=gen(10))
    total, normed = layers.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(total, x + r) and torch.equal(normed, ops.rms_norm(x + r, w, 1e-6))
    for dtype in (torch.float64, torch.bfloat16):  # not the C ops': torch's own expressions
        g, u = gate.to(dtype), up.to(dtype)
        assert torch.equal(layers.gelu_mul(g, u), F.gelu(g, approximate="tanh") * u)
        assert torch.equal(layers.silu_mul(g, u), F.silu(g) * u)
        assert torch.equal(layers.add(g, u), g + u)
        s = torch.tensor(math.sqrt(2048), dtype=dtype)
        assert torch.equal(layers.scale(g, s), g * s)
