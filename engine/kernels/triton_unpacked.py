"""A Q6_K matrix unpacked: each weight's 6-bit value as an int8 (q - 32) beside its scales, for products of 2-8 rows:
a Q6_K head's form with `--dense-tiles on` (`engine.dense_copies`, off until timed faster than the bf16 copy:
`python -m engine.kernels.sweep --tiles` times both, and the head on tiles from its blocks, `triton_tiles`).

A bf16 copy of the head takes cuBLAS's product at ~2.9 TB/s on an H100 (151,936 x 2,048, 8 rows: 211.8 us), but
reads 2 bytes a value. Unpacked, the matrix is 1.07 bytes a value: q int8 [n, k], the sub-block scales int8
[n, k // 16] and d float16 [n, k // 256] (the file's blocks are 0.82, but 210 bytes each, so most start only
2-byte aligned and their 6-bit values must be unpacked in registers: the blocks' int8 tensor-core kernel took
291.4 us). Int8 products over these values, as that kernel's (x rounded to int16 in two planes, three products a
run of 32), took 280.1 us at best: the loads were not what held it. So `_unpacked_kernel` dequantizes each tile in
registers instead, q * (d * scale) in float32 rounded to x's dtype (the bf16 copy's values, bit for bit), and
multiplies it with tl.dot over whole sub-blocks of k, float32 sums; x's rows are rows of one tile of 16, each an
MMA row of its own, so a row's bits do not depend on the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels import pdl
from engine.kernels.triton_tiles import _small_float, window_rows

BLOCK = 256  # values a Q6_K block holds
UNPACK_ROWS = 8192  # weight rows unpacked at a time: the torch ops' temporaries stay small beside the copy


@triton.jit(do_not_specialize=["m"])  # one compiled kernel for every m
def _unpacked_kernel(q, sc, d, x, y, m, n, k, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr):
    """y [m <= 16, n] = x @ W.T for weight rows program_id(0) * BN..: BK values of k a step (whole sub-blocks)."""
    pdl.wait(PDL)
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    live_n = rows < n
    row = rows.to(tl.int64)
    t = tl.arange(0, 16)
    c = tl.arange(0, BK)
    live_x = (t < m)[:, None]
    g = tl.arange(0, BK // 16)
    acc = tl.zeros((16, BN), dtype=tl.float32)
    for k0 in range(0, k, BK):
        w_q = tl.load(q + row[:, None] * k + k0 + c[None, :], mask=live_n[:, None], other=0)
        w_q = _small_float(w_q.to(tl.int32) + 32, 32)  # exactly q - 32, without the conversion units
        scale = tl.load(sc + row[:, None] * (k // 16) + k0 // 16 + g[None, :], mask=live_n[:, None], other=0)
        blk = tl.load(d + row[:, None] * (k // 256) + (k0 + 16 * g[None, :]) // 256, mask=live_n[:, None], other=0)
        scale = blk.to(tl.float32) * scale.to(tl.float32)  # [BN, BK // 16]: d times each sub-block's scale
        w = tl.reshape(tl.reshape(w_q, (BN, BK // 16, 16)) * scale[:, :, None], (BN, BK)).to(x.dtype.element_ty)
        xt = tl.load(x + t[:, None] * k + k0 + c[None, :], mask=live_x, other=0.0)
        acc = tl.dot(xt, tl.trans(w), acc)
    out = y + t[:, None] * n + rows[None, :]
    tl.store(out, acc.to(y.dtype.element_ty), mask=live_x & live_n[None, :])


@dataclass(frozen=True)
class UnpackedTiles:
    """Weight rows a program, values of k a step (a multiple of 16), warps and stages."""

    rows: int = 64
    k: int = 256
    warps: int = 4
    stages: int = 3


def unpack_q6k(blocks: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q6_K blocks, uint8 [n, k // 256 * 210], as (q int8 [n, k], the sub-block scales int8 [n, k // 16], d float16
    [n, k // 256]) on their device: q - 32 in gguf-py's order of values."""
    n, nb = blocks.shape[0], k // BLOCK
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or k % BLOCK or blocks.shape[1] != nb * 210:
        raise ValueError(f"blocks must be uint8 [n, {k // BLOCK * 210}] of Q6_K with k={k}, got {blocks.dtype} "
                         f"{tuple(blocks.shape)}")
    q = torch.empty(n, k, dtype=torch.int8, device=blocks.device)
    sc = torch.empty(n, k // 16, dtype=torch.int8, device=blocks.device)
    d = torch.empty(n, nb, dtype=torch.float16, device=blocks.device)
    for start in range(0, n, UNPACK_ROWS):
        b = blocks[start:start + UNPACK_ROWS].view(-1, nb, 210)
        ql, qh = b[..., :128].reshape(-1, nb, 2, 2, 32), b[..., 128:192].reshape(-1, nb, 2, 1, 32)
        low, high = ql & 15, ql >> 4  # [rows, nb, half, ql's 32-byte slice, 32]
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).view(1, 1, 1, 4, 1)
        runs = torch.cat((low, high), dim=3) | (((qh >> shifts) & 3) << 4)  # run r: qh's bits 2r above
        q[start:start + UNPACK_ROWS] = (runs.view(torch.int8) - 32).reshape(-1, k)
        sc[start:start + UNPACK_ROWS] = b[..., 192:208].reshape(-1, k // 16).view(torch.int8)
        d[start:start + UNPACK_ROWS] = b[..., 208:210].contiguous().view(torch.float16).reshape(-1, nb)
    return q, sc, d


def unpacked_bytes(n: int, k: int) -> int:
    """The bytes of an n x k matrix unpacked: q, the sub-block scales, d."""
    return n * k + n * (k // 16) + n * (k // BLOCK) * 2


class Unpacked:
    """An n x k Q6_K matrix unpacked (`unpack_q6k`) on its device, for products of 2-8 rows."""

    def __init__(self, blocks: torch.Tensor, k: int, tiles: UnpackedTiles | None = None):
        self.tiles = tiles or UnpackedTiles()
        if self.tiles.k % 16 or k % self.tiles.k:
            raise ValueError(f"k={k} is not whole steps of {self.tiles.k} values in sub-blocks of 16")
        self.q, self.scales, self.d = unpack_q6k(blocks, k)
        self.n, self.k = blocks.shape[0], k

    @property
    def nbytes(self) -> int:
        return unpacked_bytes(self.n, self.k)

    def matvec(self, x: torch.Tensor) -> torch.Tensor:
        """x [2-8 rows, k] of bf16 or f16 (`triton_tiles.window_rows`) @ W.T -> [m, n] in x's dtype, float32 sums."""
        x = window_rows(x, self.k, self.q.device)
        m = x.shape[0]
        t = self.tiles
        y = torch.empty(m, self.n, dtype=x.dtype, device=x.device)
        _unpacked_kernel[(triton.cdiv(self.n, t.rows),)](self.q, self.scales, self.d, x, y, m, self.n, self.k,
                                                         BN=t.rows, BK=t.k, num_warps=t.warps, num_stages=t.stages,
                                                         **pdl.launch(x.device))
        return y

