"""What the Triton kernel tests (tests/test_triton_kernels.py and tests/test_triton_moe.py in the
interpreter, tests/test_triton_gpu.py and tests/test_triton_moe_gpu.py on CUDA) check against: gguf-py's
values, error bounds, bit equality."""

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants

ACCUMULATION = 4e-5  # float32 sums over k, relative to sum |x w|
# One unit in the last place of y's dtype (the interpreter truncates to bf16, the GPU rounds to nearest).
OUTPUT_ULP = {torch.float32: 0.0, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
# W and x rounded into GEMM tiles of x's dtype (float32 tiles: tf32 on the GPU's tensor cores).
TILE_ULP = {torch.float32: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def reference(qtype: GGMLQuantizationType, blocks: torch.Tensor) -> torch.Tensor:
    """gguf-py's float32 values of the blocks, on their device."""
    values = np.asarray(quants.dequantize(blocks.cpu().numpy(), qtype), dtype=np.float32)
    return torch.from_numpy(values.reshape(blocks.shape[0], -1)).to(blocks.device)


def matvec_tolerance(dtype: torch.dtype) -> float:
    return ACCUMULATION + OUTPUT_ULP[dtype]


def gemm_tolerance(dtype: torch.dtype) -> float:
    return ACCUMULATION + 2 * TILE_ULP[dtype] + OUTPUT_ULP[dtype]


def rounding_error(x: torch.Tensor, largest: int = 32767) -> torch.Tensor:
    """Per value of x [m, k], half a step of its int16 rounding per group of 32 (`triton_xq`, taken by
    the Q4_K one-row kernels; `largest` 127: its int8 rounding)."""
    groups = x.double().abs().view(x.shape[0], -1, 32)
    return (groups.amax(-1, keepdim=True) / largest / 2).expand_as(groups).reshape(x.shape)


def assert_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, tolerance: float,
                 x_error: torch.Tensor | None = None) -> None:
    """y in x's dtype, and |y - x @ w.T| within `tolerance` of sum |x w| (float64 reference), plus
    sum |w| times `x_error` where the kernel rounds x."""
    exact = x.double() @ w.double().T
    bound = tolerance * (x.double().abs() @ w.double().abs().T)
    if x_error is not None:
        bound += (1 + tolerance) * (x_error @ w.double().abs().T)
    assert y.dtype == x.dtype and y.shape == exact.shape
    excess = (y.double() - exact).abs() - bound
    assert (excess <= 0).all(), f"worst error {excess.max().item():.3g} over the bound"


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    bits = torch.int16 if a.element_size() == 2 else torch.int32
    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(bits), b.view(bits))


SUBNORMAL = 2.0**-24  # float16's spacing below 2**-14 (the relative bounds do not cover it)


def moe_products(a: torch.Tensor, values: torch.Tensor, experts: torch.Tensor, tolerance: float,
                 rounded: torch.Tensor | None = None, largest: int = 32767) -> tuple[torch.Tensor, torch.Tensor]:
    """Each pair's row of `a` times its expert's matrix (`values` [E, n, k]) in float64, and `tolerance`
    times sum |a w| (plus `rounding_error(a, largest)` times sum |w| for the pairs `rounded` marks); one
    product per routed expert."""
    exact = torch.empty(a.shape[0], values.shape[1], dtype=torch.float64, device=a.device)
    bound = torch.empty_like(exact)
    for e in experts.unique().tolist():
        at = (experts == e).nonzero()[:, 0]
        rows, w = a[at].double(), values[e].double()
        exact[at] = rows @ w.T
        bound[at] = tolerance * (rows.abs() @ w.abs().T)
    if rounded is not None and rounded.any():
        at = rounded.nonzero()[:, 0]
        bound[at] += (1 + tolerance) * torch.stack([rounding_error(a[i:i + 1].double(), largest)[0] @ values[experts[i]].double().abs().T
                                                    for i in at.tolist()])
    return exact, bound


def decode_rounding(stack, rows: int) -> dict[str, bool | int]:
    """`check_moe`'s `rounded` and `largest` for a decode window of `rows` rows through `stack` (a
    `triton_moe.Stack`): x in int16 for Q4_K and Q6_K, in int8 in windows of 2-8 rows where its tiles say
    `int8_windows` (Q8_0's own tiles do): `triton_moe.x_rounding`, off the tensor cores."""
    from engine.kernels.triton_moe import x_rounding

    rounding = x_rounding(stack, stack, True, rows, 0)
    return dict(rounded=rounding is not None, largest=127 if rounding == torch.int8 else 32767)


def assert_within(y: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor) -> None:
    excess = (y.double() - exact).abs() - bound
    assert (excess <= 0).all(), f"worst error {excess.max().item():.3g} over the bound"


def check_moe(values: list[torch.Tensor], x: torch.Tensor, routing, h: torch.Tensor, y: torch.Tensor,
              prompt: bool, rounded: bool = False, largest: int = 32767) -> None:
    """The fused MoE kernel's h = silu(x W_gate) * (x W_up) and y = h W_down for every routed pair
    (`routing`: an `engine.kernels.triton_moe.Routing`; `values`: the gate, up and down stacks'
    values), within float32 sums (and, for prompt chunks, the GEMM's tiles of x's dtype) of the
    float64 products, each rounded once to x's dtype. `rounded`: which decode pairs take x (and h)
    rounded to int16 (Q4_K and Q6_K's matvec; `largest` 127: to int8)."""
    check_gated(values[:2], x, routing, h, prompt, rounded, largest)
    check_projected(values[2], h, routing, y, prompt, rounded, largest)


def check_gated(values: list[torch.Tensor], x: torch.Tensor, routing, h: torch.Tensor, prompt: bool,
                rounded: bool = False, largest: int = 32767) -> None:
    """`check_moe`'s h alone (`values`: the gate and up stacks' values)."""
    dtype = x.dtype
    assert h.dtype == dtype
    h = h[routing.order]  # the kernels write flat (row, choice) order: sorted here
    assert h.shape == (routing.experts.numel(), values[0].shape[1])
    sums, e, every = _pairs(routing, dtype, prompt, rounded)
    xs = x[routing.src.long()]
    gate, gate_bound = moe_products(xs, values[0], e, sums, every, largest)
    up, up_bound = moe_products(xs, values[1], e, sums, every, largest)
    silu = F.silu(gate)
    exact = silu * up
    # silu's slope is within [-0.1, 1.1]; then h's float32 sigmoid and products, and its one rounding
    bound = 1.1 * gate_bound * (up.abs() + up_bound) + silu.abs() * up_bound
    assert_within(h, exact, bound + (OUTPUT_ULP[dtype] + 2**-20) * (exact.abs() + bound) + SUBNORMAL)


def check_projected(values: torch.Tensor, h: torch.Tensor, routing, y: torch.Tensor, prompt: bool,
                    rounded: bool = False, largest: int = 32767) -> None:
    """`check_moe`'s y = h W_down alone, h in the kernels' flat order (`values`: the down stack's values)."""
    dtype = h.dtype
    assert y.dtype == dtype
    h, y = h[routing.order], y[routing.order]
    assert y.shape == (routing.experts.numel(), values.shape[1])
    sums, e, every = _pairs(routing, dtype, prompt, rounded)
    exact, bound = moe_products(h, values, e, sums + OUTPUT_ULP[dtype], every, largest)
    assert_within(y, exact, bound + SUBNORMAL)


def _pairs(routing, dtype: torch.dtype, prompt: bool, rounded: bool) -> tuple[float, torch.Tensor, torch.Tensor | None]:
    """The float32 sums' relative bound, each sorted pair's expert, and which pairs take int16-rounded input."""
    e = routing.experts.long()
    every = torch.ones_like(e, dtype=torch.bool) if rounded and not prompt else None
    return ACCUMULATION + (2 * TILE_ULP[dtype] if prompt else 0.0), e, every


def per_pair(routing, y: torch.Tensor) -> torch.Tensor:
    """y's rows (the kernels' flat (row, choice) order) as [rows, top_k, n], whatever the window."""
    return y.view(routing.rows, -1, y.shape[1])
