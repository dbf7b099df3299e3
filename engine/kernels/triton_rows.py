"""Row-wise ops of a CUDA forward in one Triton launch each: RMSNorm (alone, or after a residual add)
and rotary embedding (what engine/layers.py's `rms_norm`, `add_rms_norm` and `Rope` run for CUDA
tensors; in torch they took ~7 elementwise kernels each).

Both compute in float32 and round once to x's dtype. No host sync and no shape that depends on data
(they run inside CUDA graph capture): rope reads each row's position on the device. Tile sizes come from
the row length (and the head count) only, and a row's result depends only on that row: the same bits
whatever the number of rows in the call. Multiply-adds are not fused, as torch's separate kernels round
each product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import pdl
from engine.kernels.triton_blocks import MATVEC_ROWS
from engine.kernels.triton_xq import GROUP, RoundedRows, round_groups

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TILE = 1024  # values a program handles when rows are shorter (several rows, or several heads)
_UNFUSED = dict(enable_fp_fusion=False)


@triton.jit
def _normed(v, w, y, at, mask, i, d, eps, q, scale, sums, halves, hi, lo, ROUND: tl.constexpr, BLOCK: tl.constexpr,
            PLANES: tl.constexpr):
    """Store the RMSNorm of v [ROWS, BLOCK] (float32) times w at `at`; ROUND (one row a program): that row
    rounded for the int16 products as well (`triton_xq.round_groups`, from the values as stored; PLANES: split
    into int8 planes too)."""
    scale_v = tl.rsqrt(tl.sum(v * v, axis=1)[:, None] / d + eps)
    out = (v * scale_v * tl.load(w + i, mask=i < d, other=0.0).to(tl.float32)).to(y.dtype.element_ty)
    tl.store(y + at, out, mask=mask)
    if ROUND:
        g = tl.arange(0, BLOCK // 32)[:, None]
        round_groups(tl.reshape(out.to(tl.float32), (BLOCK // 32, 32)), g, g < d // 32, q, scale, sums, halves, hi,
                     lo, tl.program_id(0).to(tl.int64), d, BLOCK // 32, PLANES)


@triton.jit(do_not_specialize=["rows"])  # one compiled kernel for every number of rows
def _rms_norm_kernel(x, w, y, q, scale, sums, halves, hi, lo, rows, d, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                     ROUND: tl.constexpr, PLANES: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
    i = tl.arange(0, BLOCK)[None, :]
    mask = (r < rows) & (i < d)
    at = r.to(tl.int64) * d + i
    v = tl.load(x + at, mask=mask, other=0.0).to(tl.float32)
    _normed(v, w, y, at, mask, i, d, eps, q, scale, sums, halves, hi, lo, ROUND, BLOCK, PLANES)


@triton.jit(do_not_specialize=["rows"])
def _add_rms_norm_kernel(x, r, w, s, y, q, scale, sums, halves, hi, lo, rows, d, eps, ROWS: tl.constexpr,
                         BLOCK: tl.constexpr, ROUND: tl.constexpr, PLANES: tl.constexpr, PDL: tl.constexpr):
    """s = x + r rounded to s's dtype (as torch's add), y = the RMSNorm of s as stored."""
    pdl.wait(PDL)
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
    i = tl.arange(0, BLOCK)[None, :]
    mask = (row < rows) & (i < d)
    at = row.to(tl.int64) * d + i
    total = tl.load(x + at, mask=mask, other=0.0).to(tl.float32) + tl.load(r + at, mask=mask, other=0.0).to(tl.float32)
    stored = total.to(s.dtype.element_ty)
    tl.store(s + at, stored, mask=mask)
    _normed(stored.to(tl.float32), w, y, at, mask, i, d, eps, q, scale, sums, halves, hi, lo, ROUND, BLOCK, PLANES)


@triton.jit
def _rope_heads(x, y, positions, cos, sin, w, eps, heads, half, stride, n, tile, NEOX: tl.constexpr,
                NORM: tl.constexpr, HEADS: tl.constexpr, HALF: tl.constexpr):
    """Heads tile * HEADS.. of row n of x [N, heads, 2 * half] (rows `stride` values apart: a column slice of a
    joined product) into y's row n (contiguous), rotated (RMS-normed with w first when NORM)."""
    h = tile * HEADS + tl.arange(0, HEADS)[:, None]
    j = tl.arange(0, HALF)[None, :]
    mask = (h < heads) & (j < half)
    at = tl.load(positions + n).to(tl.int64) * half + j
    c = tl.load(cos + at, mask=j < half, other=0.0)
    s = tl.load(sin + at, mask=j < half, other=0.0)
    if NEOX:  # pairs (j, j + D/2)
        first = j
        second = first + half
    else:  # pairs (2j, 2j + 1)
        first = 2 * j
        second = first + 1
    src = n.to(tl.int64) * stride + h * (2 * half)
    x1 = tl.load(x + src + first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x + src + second, mask=mask, other=0.0).to(tl.float32)
    if NORM:  # each head RMS-normed with weight w [D] first, in the same registers
        scale = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1))[:, None] / (2 * half) + eps)
        x1 = x1 * scale * tl.load(w + first, mask=j < half, other=0.0).to(tl.float32)
        x2 = x2 * scale * tl.load(w + second, mask=j < half, other=0.0).to(tl.float32)
    dst = (n.to(tl.int64) * heads + h) * (2 * half)
    tl.store(y + dst + first, (x1 * c - x2 * s).to(y.dtype.element_ty), mask=mask)
    tl.store(y + dst + second, (x2 * c + x1 * s).to(y.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(x, y, positions, cos, sin, w, eps, heads, half, stride, x2, y2, w2, eps2, heads2, stride2, tiles,
                 NEOX: tl.constexpr, NORM: tl.constexpr, HEADS: tl.constexpr, HALF: tl.constexpr, PDL: tl.constexpr):
    """Row program_id(0): the first `tiles` programs of axis 1 rotate x's heads, the others x2's (q and k
    of a layer in one launch; each head's arithmetic the same either way)."""
    pdl.wait(PDL)
    n = tl.program_id(0)
    t = tl.program_id(1)
    if t < tiles:
        _rope_heads(x, y, positions, cos, sin, w, eps, heads, half, stride, n, t, NEOX, NORM, HEADS, HALF)
    else:
        _rope_heads(x2, y2, positions, cos, sin, w2, eps2, heads2, half, stride2, n, t - tiles, NEOX, NORM, HEADS,
                    HALF)


def _warps(values: int) -> int:
    return min(16, max(1, values // 256))


def _check_norm(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dtype not in DTYPES or x.dim() == 0:
        raise ValueError(f"x must be a float32/bf16/f16 tensor [..., D], got {x.dtype} {tuple(x.shape)}")
    d = x.shape[-1]
    if weight.shape != (d,) or not weight.is_floating_point() or weight.device != x.device:
        raise ValueError(f"weight must be a float vector [{d}] on {x.device}, got {weight.dtype} "
                         f"{tuple(weight.shape)} on {weight.device}")


def _launch_norm(kernel, x: torch.Tensor, inputs: tuple, weight: torch.Tensor, outputs: tuple, eps: float) -> None:
    """One program per row (or per rows of a short row); a window of up to `MATVEC_ROWS` rows of a length that
    is a multiple of 32 also rounded for the int16 products (`RoundedRows.remember`) where the device has
    one (`RoundedRows.wanted`)."""
    d = x.shape[-1]
    rows, block = x.numel() // d, triton.next_power_of_2(d)
    per_program = max(1, TILE // block)
    rounds = per_program == 1 and rows <= MATVEC_ROWS and d % GROUP == 0 and RoundedRows.wanted(x.device)
    rounded = RoundedRows.for_window(rows, d, x.device) if rounds else None
    rounding, flags = RoundedRows.kernel_args(rounded, x)
    kernel[(triton.cdiv(rows, per_program),)](
        *inputs, weight.contiguous(), *outputs, *rounding, rows, d, eps, ROWS=per_program, BLOCK=block, **flags,
        num_warps=_warps(per_program * block), **_UNFUSED, **pdl.launch(x.device))
    if rounded is not None:
        rounded.remember(outputs[-1].view(rows, d))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dimension D of x [..., D] (float32/bf16/f16),
    weight [D]; in x's dtype."""
    _check_norm(x, weight)
    x = x.contiguous()
    y = torch.empty_like(x)
    if x.numel():
        _launch_norm(_rms_norm_kernel, x, (x,), weight, (y,), eps)
    return y


def add_rms_norm(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + r, `rms_norm` of it) in one launch, each in x's dtype: the sum rounded once, as torch's add
    rounds it, then normed from the rounded values (the bits of the add and the norm run apart)."""
    _check_norm(x, weight)
    if r.shape != x.shape or r.dtype != x.dtype or r.device != x.device:
        raise ValueError(f"r must match x {x.dtype} {tuple(x.shape)}, got {r.dtype} {tuple(r.shape)} on {r.device}")
    x, r = x.contiguous(), r.contiguous()
    s, y = torch.empty_like(x), torch.empty_like(x)
    if x.numel():
        _launch_norm(_add_rms_norm_kernel, x, (x, r), weight, (s, y), eps)
    return s, y


def rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool,
         norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """x [N, heads, D] (float32/bf16/f16) rotated at positions [N] (integers on x's device, each in
    [0, context): not checked, that would need a host sync), tables cos/sin float32 [context, D/2]:
    pairs (i, i + D/2) when `neox`, else adjacent pairs (2i, 2i + 1), llama.cpp's normal rope. `norm`
    (weight [D], eps): each head RMS-normed first in the same launch (Qwen3's and Gemma 3's q/k norms;
    not rounded to x's dtype in between). A new tensor in x's dtype."""
    return rope_pair(x, None, positions, cos, sin, neox, norm, None)[0]


def rope_pair(q: torch.Tensor, k: torch.Tensor | None, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              neox: bool, q_norm: tuple[torch.Tensor, float] | None = None,
              k_norm: tuple[torch.Tensor, float] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`rope` of q and of k (each with its own norm, both or neither) in one launch (a layer's q and k);
    the tiles come from both shapes, so a row's bits do not depend on the other rows."""
    _check_rope(q, positions, cos, sin, q_norm)
    if k is not None:
        _check_rope(k, positions, cos, sin, k_norm)
        if k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2] or k.dtype != q.dtype or (q_norm is None) != (
                k_norm is None):
            raise ValueError(f"k must be [{q.shape[0]}, heads, {q.shape[2]}] of {q.dtype}, normed as q is, got "
                             f"{k.dtype} {tuple(k.shape)}")
    q, cos, sin = rows_of_heads(q), cos.contiguous(), sin.contiguous()
    yq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k = q if k is None else rows_of_heads(k)
    yk = yq if k is q else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if q.numel() == 0:
        return yq, (None if k is q else yk)
    n, _, d = q.shape
    half = d // 2
    block = triton.next_power_of_2(half)
    heads = (q.shape[1], k.shape[1] if k is not q else 0)
    per_program = min(triton.next_power_of_2(max(heads)), max(1, TILE // block))  # from the shapes only
    tiles = [triton.cdiv(h, per_program) for h in heads]
    wq, eq = (q_norm[0].contiguous(), q_norm[1]) if q_norm is not None else (q, 0.0)
    wk, ek = (k_norm[0].contiguous(), k_norm[1]) if k_norm is not None else (wq, eq)
    _rope_kernel[(n, tiles[0] + tiles[1])](
        q, yq, positions, cos, sin, wq, eq, heads[0], half, q.stride(0), k, yk, wk, ek, max(heads[1], 1), k.stride(0),
        tiles[0], NEOX=neox,
        NORM=q_norm is not None, HEADS=per_program, HALF=block, num_warps=_warps(per_program * block), **_UNFUSED,
        **pdl.launch(q.device))
    return yq, (None if k is q else yk)


def rows_of_heads(x: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D] as the kernels read it: each row's heads contiguous, its rows at any stride (q, k and v of
    several rows are column slices of one joined product: read in place, not copied); else a contiguous copy."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def _check_rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                norm: tuple[torch.Tensor, float] | None) -> None:
    if x.dtype not in DTYPES or x.dim() != 3 or x.shape[-1] % 2:
        raise ValueError(f"x must be a float32/bf16/f16 tensor [N, heads, D] with D even, got {x.dtype} "
                         f"{tuple(x.shape)}")
    n, heads, d = x.shape
    half = d // 2
    if positions.shape != (n,) or positions.dtype not in (torch.int64, torch.int32) or positions.device != x.device:
        raise ValueError(f"positions must be an int64/int32 vector [{n}] on {x.device}, got {positions.dtype} "
                         f"{tuple(positions.shape)} on {positions.device}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dtype != torch.float32 or table.dim() != 2 or table.shape[1] != half or table.device != x.device:
            raise ValueError(f"{name} must be a float32 table [context, {half}] on {x.device}, got {table.dtype} "
                             f"{tuple(table.shape)} on {table.device}")
    if norm is not None and (norm[0].shape != (d,) or not norm[0].is_floating_point() or norm[0].device != x.device):
        raise ValueError(f"the norm's weight must be a float vector [{d}] on {x.device}, got {norm[0].dtype} "
                         f"{tuple(norm[0].shape)} on {norm[0].device}")
