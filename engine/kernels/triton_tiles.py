"""Q4_K matrices' products of 2-8 rows on bf16 tiles dequantized in registers from the file's blocks: a candidate for
the layers' dense copies (`engine.dense_copies`), which read 2 bytes a value where the blocks read 0.5625.

Each step of a program takes one block (256 values) of each of its weight rows: the block's 128 bytes of nibble
pairs in one load (the blocks are 144 bytes, so 16-byte aligned where a row's bytes are), its eight scales and mins
(`_k_scales`). The low nibbles (values 64j + l of the block) and the high ones (64j + 32 + l) are dequantized apart,
q * scale - min in float32 rounded to x's dtype (the dequantized copy's values, bit for bit: no fused multiply-add,
as `dequantize_blocks`), and each multiplied with tl.dot by the x values of the same places, float32 sums. x's rows
are rows of one tile of 16, each an MMA row of its own, so a row's bits do not depend on the others. Small matrices
cut k into parts (`Q4kTiles.parts`), each a program of its own, added in order by `_add_parts`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as Q

from engine.kernels import pdl
from engine.kernels.gpu import MATVEC_ROWS
from engine.kernels.triton_blocks import _add_parts, _k_scales, row_bytes

BLOCK, BLOCK_BYTES = 256, 144  # a Q4_K block's values and bytes: d, dmin, 12 bytes of scales, 128 of nibble pairs
HALF_DTYPES = (torch.bfloat16, torch.float16)  # x's types: the tensor cores' 16-bit inputs


@triton.jit
def _half_tile(nibbles, scale, minimum, BN: tl.constexpr, dtype: tl.constexpr):
    """[BN, 128] weights of x's dtype: nibbles [BN, 128] (four runs of 32) times their run's scale, less its min."""
    w = tl.reshape(nibbles.to(tl.float32), (BN, 4, 32)) * scale[:, :, None] - minimum[:, :, None]
    return tl.reshape(w, (BN, 128)).to(dtype)


@triton.jit(do_not_specialize=["m", "per"])  # one compiled kernel for every m and part
def _q4k_tiles_kernel(w, x, out, m, n, k, row_bytes, per, BN: tl.constexpr, PDL: tl.constexpr):
    """Part s = program_id(1) of y [m <= 8, n] = x @ W.T: blocks [s * per, (s + 1) * per) of weight rows
    program_id(0) * BN.., into `out` (y itself for one part, else float32 [parts, 8, n])."""
    pdl.wait(PDL)
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    part = tl.program_id(1)
    live_n = rows < n
    row = rows.to(tl.int64) * row_bytes
    t = tl.arange(0, 16)
    live_x = (t < m)[:, None]
    c = tl.arange(0, 128)
    at = 64 * (c // 32) + c % 32  # the value of a block each byte's low nibble holds; its high nibble's is 32 on
    j = tl.arange(0, 4)[None, :]  # byte run j's low nibbles are sub-block 2j, its high ones 2j + 1
    dtype = x.dtype.element_ty
    acc = tl.zeros((16, BN), dtype=tl.float32)
    for b in range(part * per, (part + 1) * per):
        blk = row + b * 144
        qs = tl.load(w + blk[:, None] + 16 + c[None, :], mask=live_n[:, None], other=0)
        sc_lo, mn_lo = _k_scales(w, blk[:, None], 2 * j, live_n[:, None])
        sc_hi, mn_hi = _k_scales(w, blk[:, None], 2 * j + 1, live_n[:, None])
        w_lo = _half_tile(qs & 15, sc_lo, mn_lo, BN, dtype)
        w_hi = _half_tile(qs >> 4, sc_hi, mn_hi, BN, dtype)
        xp = x + t[:, None] * k + b * 256 + at[None, :]
        acc = tl.dot(tl.load(xp, mask=live_x, other=0.0), tl.trans(w_lo), acc)
        acc = tl.dot(tl.load(xp + 32, mask=live_x, other=0.0), tl.trans(w_hi), acc)
    tl.store(out + part * 8 * n + t[:, None] * n + rows[None, :], acc.to(out.dtype.element_ty),
             mask=live_x & live_n[None, :])


@dataclass(frozen=True)
class TileLaunch:
    """Weight rows a program (at least 16), warps, stages, and the parts k is cut into (whole blocks each)."""

    rows: int = 32
    warps: int = 4
    stages: int = 3
    parts: int = 1


def launch_for(n: int, k: int) -> TileLaunch:
    """The launch for an n x k matrix, from its shape only (so never from the window's rows)."""
    return TileLaunch()


class Q4kTiles:
    """An n x k Q4_K matrix's blocks (uint8 [n, k // 256 * 144] on a CUDA device or, interpreted, the CPU), for
    products of 2-8 rows on dequantized bf16/f16 tiles."""

    def __init__(self, blocks: torch.Tensor, k: int, launch: TileLaunch | None = None):
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or k % BLOCK or blocks.shape[1] != row_bytes(Q.Q4_K, k):
            raise ValueError(f"blocks must be uint8 [n, {k // BLOCK * BLOCK_BYTES}] of Q4_K with k={k}, got "
                             f"{blocks.dtype} {tuple(blocks.shape)}")
        self.blocks, self.n, self.k = blocks, blocks.shape[0], k
        self.launch = launch or TileLaunch()
        if (k // BLOCK) % self.launch.parts or self.launch.rows < 16:
            raise ValueError(f"{self.launch} does not cut k={k} into whole blocks, or has fewer than 16 rows")

    def matvec(self, x: torch.Tensor) -> torch.Tensor:
        """x [2 <= m <= MATVEC_ROWS, k] of bf16 or f16 @ W.T -> [m, n] in x's dtype, float32 sums."""
        m = x.shape[0]
        if (x.dim() != 2 or x.shape[1] != self.k or not 1 < m <= MATVEC_ROWS or x.device != self.blocks.device
                or x.dtype not in HALF_DTYPES):
            raise ValueError(f"x must be a bf16/f16 tensor [2-{MATVEC_ROWS}, {self.k}] on {self.blocks.device}, got "
                             f"{x.dtype} {tuple(x.shape)} on {x.device}")
        x = x if x.is_contiguous() and x.data_ptr() % 16 == 0 else x.clone()  # a kernel per alignment
        t, parts = self.launch, self.launch.parts
        y = torch.empty(m, self.n, dtype=x.dtype, device=x.device)
        out = y if parts == 1 else torch.empty(parts, MATVEC_ROWS, self.n, dtype=torch.float32, device=x.device)
        _q4k_tiles_kernel[(triton.cdiv(self.n, t.rows), parts)](
            self.blocks, x, out, m, self.n, self.k, self.blocks.shape[1], self.k // BLOCK // parts, BN=t.rows,
            num_warps=t.warps, num_stages=t.stages, enable_fp_fusion=False, **pdl.launch(x.device))
        if parts > 1:
            _add_parts[(triton.cdiv(m * self.n, 1024),)](out, y, m, self.n, PARTS=parts, BLOCK=1024,
                                                         **pdl.launch(x.device))
        return y
