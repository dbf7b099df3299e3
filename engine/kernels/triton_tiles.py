"""Q4_K and Q6_K products of 2-8 rows on bf16/f16 tiles dequantized in registers from the file's blocks: for the
layers' dense matrices (`engine.dense_copies`, `--dense-tiles on`: instead of bf16 copies, which read 2 bytes a value
where Q4_K blocks read 0.5625) and for the fused MoE kernel's runs (`triton_moe.Tiles.tile_runs`).

`tile_sums` takes one block (256 values) of each weight row a step: a Q4_K block's 128 bytes of nibble pairs in one
load (the blocks are 144 bytes, so 16-byte aligned where a row's bytes are) and its eight scales and mins
(`_k_scales`); a Q6_K block's 128 bytes of low nibbles, its 64 of high bit pairs (each loaded for the two tiles that
use it), its 16 scales and d. Each block is two tiles of 128 values (`_q4k_halves`, `_q6k_halves`), dequantized in
float32 to x's dtype (the dequantized copy's values, bit for bit, where launched without fused multiply-adds, as
`dequantize_blocks`), each multiplied with tl.dot by x's values of the same places, float32 sums. x's rows are rows of
one tile of 16, each an MMA row of its own, so a row's bits do not depend on the others. Small matrices cut k into
parts (`TileLaunch.parts`), each a program of its own, added in order by `_add_parts`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as Q

from engine.kernels import pdl
from engine.kernels.gpu import MATVEC_ROWS
from engine.kernels.triton_blocks import _Q4_K, _add_parts, _f16, _k_scales, _signed, row_bytes

BLOCK = 256  # values a K-quant block holds
TYPES = (Q.Q4_K, Q.Q6_K)
HALF_DTYPES = (torch.bfloat16, torch.float16)  # x's types: the tensor cores' 16-bit inputs


@triton.jit
def _small_float(q, OFFSET: tl.constexpr):
    """q - OFFSET as float32, exactly, for integers 0 <= q < 2**23: q's bits under 2**23's exponent (the float 2**23 +
    q) less 2**23 + OFFSET. A logic op and an add, where a conversion instruction runs at a fraction of the adds' rate
    (CUDA's table of instruction throughputs) and a window's tiles convert every weight value they read."""
    return (q.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + OFFSET)


@triton.jit
def _scaled(q, scale, minimum, BN: tl.constexpr, G: tl.constexpr, dtype: tl.constexpr, HAS_MIN: tl.constexpr,
            OFFSET: tl.constexpr):
    """[BN, 128] of `dtype`: q - OFFSET (q [BN, 128]: G runs of 128 // G values, each 0 <= q < 2**23) times its run's
    scale [BN, G], less its run's minimum [BN, G] where HAS_MIN, in float32."""
    w = tl.reshape(_small_float(q, OFFSET), (BN, G, 128 // G)) * scale[:, :, None]
    if HAS_MIN:
        w -= minimum[:, :, None]
    return tl.reshape(w, (BN, 128)).to(dtype)


@triton.jit
def _q4k_halves(w, blk, live, BN: tl.constexpr, dtype: tl.constexpr):
    """The Q4_K block at bytes blk [BN] of each weight row as two [BN, 128] tiles: its low nibbles (values 64j + l of
    the block, j < 4, l < 32) and its high ones (64j + 32 + l), q * scale - min. Byte run j's low nibbles are
    sub-block 2j, its high ones 2j + 1."""
    c = tl.arange(0, 128)
    j = tl.arange(0, 4)[None, :]
    qs = tl.load(w + blk[:, None] + 16 + c[None, :], mask=live[:, None], other=0)
    sc_lo, mn_lo = _k_scales(w, blk[:, None], 2 * j, live[:, None])
    sc_hi, mn_hi = _k_scales(w, blk[:, None], 2 * j + 1, live[:, None])
    lo = _scaled(qs & 15, sc_lo, mn_lo, BN, 4, dtype, True, 0)
    return lo, _scaled(qs >> 4, sc_hi, mn_hi, BN, 4, dtype, True, 0)


@triton.jit
def _q6k_halves(w, blk, live, BN: tl.constexpr, dtype: tl.constexpr):
    """The Q6_K block at bytes blk [BN] of each weight row as two [BN, 128] tiles: the values of its 128 bytes of low
    nibbles' low halves (values 128h + c of the block, h < 2, c < 64) and of their high halves (128h + 64 + c), each
    with its two high bits, (q - 32) * (d * scale)."""
    c = tl.arange(0, 128)
    ql = tl.load(w + blk[:, None] + c[None, :], mask=live[:, None], other=0).to(tl.int32)
    qh = tl.load(w + blk[:, None] + 128 + (32 * (c // 64) + c % 32)[None, :], mask=live[:, None], other=0).to(tl.int32)
    shift = (2 * (c % 64 // 32))[None, :]
    lo = (ql & 15) | (((qh >> shift) & 3) << 4)
    hi = (ql >> 4) | (((qh >> (shift + 4)) & 3) << 4)
    g = tl.arange(0, 8)[None, :]  # the tiles' runs of 16: lo's are sub-blocks 8 (g // 4) + g % 4, hi's 4 further
    d = _f16(w, blk[:, None] + 208, live[:, None])
    sub = blk[:, None] + 192 + 8 * (g // 4) + g % 4
    lo = _scaled(lo, d * _signed(w, sub, live[:, None]), d, BN, 8, dtype, False, 32)
    return lo, _scaled(hi, d * _signed(w, sub + 4, live[:, None]), d, BN, 8, dtype, False, 32)


@triton.jit
def _block_dots(w, blk, live, x_lo, x_hi, acc, QTYPE: tl.constexpr, BN: tl.constexpr):
    """acc [16, BN] + x's values of a block (x_lo, x_hi [16, 128]: the places of its two tiles) times the weight rows'
    block at bytes blk [BN] of w."""
    if QTYPE == _Q4_K:
        w_lo, w_hi = _q4k_halves(w, blk, live, BN, x_lo.dtype)
    else:
        w_lo, w_hi = _q6k_halves(w, blk, live, BN, x_lo.dtype)
    return tl.dot(x_hi, tl.trans(w_hi), tl.dot(x_lo, tl.trans(w_lo), acc))


@triton.jit
def tile_sums(w, w2, row, live, x_at, x_live, b0, b1, acc, acc2, QTYPE: tl.constexpr, BN: tl.constexpr,
              BOTH: tl.constexpr):
    """acc [16, BN] += the x rows at x_at [16, 1] (pointers to each row's values; x_live [16, 1]) times the weight
    rows at bytes `row` [BN] of w (live [BN]) over k's blocks [b0, b1); BOTH: acc2 += the same x times w2's rows (a
    matrix of w's type and shape), each x tile loaded once for both. Each block's weights are two tiles of x's dtype
    (`_q4k_halves`, `_q6k_halves`), each multiplied with tl.dot by x's values at the same places, float32 sums."""
    c = tl.arange(0, 128)
    if QTYPE == _Q4_K:  # a block's bytes; the values the low tile holds, the high tile's `far` on
        size = 144
        at = 64 * (c // 32) + c % 32
        far = 32
    else:
        size = 210
        at = 128 * (c // 64) + c % 64
        far = 64
    for b in range(b0, b1):
        blk = row + b * size
        x_lo = tl.load(x_at + b * 256 + at[None, :], mask=x_live, other=0.0)
        x_hi = tl.load(x_at + b * 256 + far + at[None, :], mask=x_live, other=0.0)
        acc = _block_dots(w, blk, live, x_lo, x_hi, acc, QTYPE, BN)
        if BOTH:
            acc2 = _block_dots(w2, blk, live, x_lo, x_hi, acc2, QTYPE, BN)
    return acc, acc2


@triton.jit(do_not_specialize=["m", "per"])  # one compiled kernel for every m and part
def _tiles_kernel(w, x, out, m, n, k, row_bytes, per, QTYPE: tl.constexpr, BN: tl.constexpr, PDL: tl.constexpr):
    """Part s = program_id(1) of y [m <= 8, n] = x @ W.T: blocks [s * per, (s + 1) * per) of weight rows
    program_id(0) * BN.., into `out` (y itself for one part, else float32 [parts, 8, n])."""
    pdl.wait(PDL)
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    part = tl.program_id(1)
    live_n = rows < n
    t = tl.arange(0, 16)
    live_x = (t < m)[:, None]
    acc = tl.zeros((16, BN), dtype=tl.float32)
    acc, _ = tile_sums(w, w, rows.to(tl.int64) * row_bytes, live_n, x + t[:, None] * k, live_x, part * per,
                       (part + 1) * per, acc, acc, QTYPE, BN, False)
    tl.store(out + part * 8 * n + t[:, None] * n + rows[None, :], acc.to(out.dtype.element_ty),
             mask=live_x & live_n[None, :])


def window_rows(x: torch.Tensor, k: int, device: torch.device) -> torch.Tensor:
    """x [2-8, k] of bf16 or f16 on `device`, checked, copied where its rows do not start 16-byte aligned (Triton
    compiles a kernel per alignment: every call of a matrix must run one)."""
    if (x.dim() != 2 or x.shape[1] != k or not 1 < x.shape[0] <= MATVEC_ROWS or x.device != device
            or x.dtype not in HALF_DTYPES):
        raise ValueError(f"x must be a bf16/f16 tensor [2-{MATVEC_ROWS}, {k}] on {device}, got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")
    return x if x.is_contiguous() and x.data_ptr() % 16 == 0 else x.clone()


@dataclass(frozen=True)
class TileLaunch:
    """Weight rows a program (at least 16), warps, stages, and the parts k is cut into (whole blocks each)."""

    rows: int = 32
    warps: int = 4
    stages: int = 3
    parts: int = 1


class BlockTiles:
    """An n x k Q4_K or Q6_K matrix's blocks (uint8 [n, row_bytes] on a CUDA device or, interpreted, the CPU), for
    products of 2-8 rows on dequantized bf16/f16 tiles."""

    def __init__(self, qtype: Q, blocks: torch.Tensor, k: int, launch: TileLaunch | None = None):
        if qtype not in TYPES:
            raise ValueError(f"{Q(qtype).name} has no tiles (Q4_K and Q6_K do)")
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or k % BLOCK or blocks.shape[1] != row_bytes(qtype, k):
            raise ValueError(f"blocks must be uint8 [n, {row_bytes(qtype, k)}] of {qtype.name} with k={k}, got "
                             f"{blocks.dtype} {tuple(blocks.shape)}")
        self.qtype, self.blocks, self.n, self.k = qtype, blocks, blocks.shape[0], k
        self.launch = launch or TileLaunch()
        if (k // BLOCK) % self.launch.parts or self.launch.rows < 16:
            raise ValueError(f"{self.launch} does not cut k={k} into whole blocks, or has fewer than 16 rows")

    def matvec(self, x: torch.Tensor) -> torch.Tensor:
        """x [2 <= m <= MATVEC_ROWS, k] of bf16 or f16 @ W.T -> [m, n] in x's dtype, float32 sums."""
        x = window_rows(x, self.k, self.blocks.device)
        m = x.shape[0]
        t, parts = self.launch, self.launch.parts
        y = torch.empty(m, self.n, dtype=x.dtype, device=x.device)
        out = y if parts == 1 else torch.empty(parts, MATVEC_ROWS, self.n, dtype=torch.float32, device=x.device)
        _tiles_kernel[(triton.cdiv(self.n, t.rows), parts)](
            self.blocks, x, out, m, self.n, self.k, self.blocks.shape[1], self.k // BLOCK // parts,
            QTYPE=int(self.qtype), BN=t.rows, num_warps=t.warps, num_stages=t.stages, enable_fp_fusion=False,
            **pdl.launch(x.device))
        if parts > 1:
            _add_parts[(triton.cdiv(m * self.n, 1024),)](out, y, m, self.n, PARTS=parts, BLOCK=1024,
                                                         **pdl.launch(x.device))
        return y
