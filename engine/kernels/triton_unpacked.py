"""A Q6_K matrix unpacked for the tensor cores: each weight's 6-bit value as an int8 (q - 32), for products of 2-8
rows (a dense copy of the head, `engine.dense_copies`).

The file's Q6_K blocks are 210 bytes, so most of them start only 2-byte aligned: the blocks' tensor-core kernel
(`triton_blocks._q6k_mma`) loads them 16 bits at a time and makes each run's int8 values in registers (on an H100
the head's 8 rows took 278.9 us for its 255 MB). Unpacked, a run of 32 values is one aligned 32-byte load: q int8
[n, k], the sub-block scales int8 [n, k // 16] and d float16 [n, k // 256], 1.07 bytes a value against the blocks'
0.82 and a bf16 copy's 2. The sums are `_q6k_mma`'s, bit for bit: the same int8 products (x rounded to int16, as
two int8 planes) and the same floats after them in the same order, so a row's bits do not depend on the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as Q

from engine.kernels import pdl
from engine.kernels.gpu import MATVEC_ROWS
from engine.kernels.triton_blocks import X_DTYPES, _add_parts, _halves_of, _int8_sums, _x_planes
from engine.kernels.triton_xq import RoundedRows

BLOCK = 256  # values a Q6_K block holds
UNPACK_ROWS = 8192  # weight rows unpacked at a time: the torch ops' temporaries stay small beside the copy


@triton.jit(do_not_specialize=["m", "per"])  # one compiled kernel for every m
def _unpacked_kernel(q, sc, d, x_hi, x_lo, xs, out, m, n, k, per, R: tl.constexpr, PDL: tl.constexpr):
    """Part s = program_id(1) of y [m <= 8, n]: blocks [s * per, (s + 1) * per) of weight rows program_id(0) * R..,
    into `out` (y itself for one part, else float32 [parts, 8, n]). Tile row t holds x row t % 8's first 16
    values of a run (t < 8) or its last 16 (the run's two scales), as `_q6k_mma`'s."""
    pdl.wait(PDL)
    rows = tl.program_id(0) * R + tl.arange(0, R)
    part = tl.program_id(1)
    live_n = rows < n
    t = tl.arange(0, 16)
    half = t // 8
    x_row = (t % 8).to(tl.int64)
    x_live = x_row < m
    c = tl.arange(0, 32)
    live = x_live[:, None] & (c[None, :] // 16 == half[:, None])
    x_at = x_row[:, None] * k + c[None, :]
    row = rows.to(tl.int64)
    q_at = row[:, None] * k + c[None, :]
    acc = tl.zeros((R, 16), dtype=tl.float32)
    for b in range(part * per, (part + 1) * per):
        scale_d = tl.load(d + row * (k // 256) + b, mask=live_n, other=0).to(tl.float32)
        for h in tl.static_range(2):
            for r in tl.static_range(4):  # run r of half h: values 128h + 32r.., sub-blocks 8h + 2r and 8h + 2r + 1
                v = b * 256 + h * 128 + r * 32
                w_q = tl.load(q + q_at + v, mask=live_n[:, None], other=0)
                x_t = _x_planes(x_hi, x_lo, x_at + v, live, True)
                s = _int8_sums(w_q, x_t[0], x_t[1], live)
                first = tl.load(sc + row * (k // 16) + v // 16, mask=live_n, other=0).to(tl.float32)
                second = tl.load(sc + row * (k // 16) + v // 16 + 1, mask=live_n, other=0).to(tl.float32)
                scale = scale_d[:, None] * tl.where(half[None, :] == 0, first[:, None], second[:, None])
                xsc = tl.load(xs + x_row * (k // 32) + v // 32, mask=x_live, other=0.0)
                acc += scale * (s.to(tl.float32) * xsc[None, :])
    r8 = tl.arange(0, 8)[:, None]
    tl.store(out + part * 8 * n + r8 * n + rows[None, :], _halves_of(acc, R).to(out.dtype.element_ty),
             mask=(r8 < m) & live_n[None, :])


@dataclass(frozen=True)
class UnpackedTiles:
    """Weight rows a program, warps, stages and parts of k (each a program; `_add_parts` adds them in order)."""

    rows: int = 32
    warps: int = 2
    stages: int = 2
    parts: int = 1


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
        self.q, self.scales, self.d = unpack_q6k(blocks, k)
        self.n, self.k = blocks.shape[0], k
        self.tiles = tiles or UnpackedTiles()
        if (k // BLOCK) % self.tiles.parts:
            raise ValueError(f"k={k} is not {self.tiles.parts} parts of whole blocks")
        RoundedRows.want(blocks.device, planes=True)

    @property
    def nbytes(self) -> int:
        return unpacked_bytes(self.n, self.k)

    def matvec(self, x: torch.Tensor) -> torch.Tensor:
        """x [2 <= m <= MATVEC_ROWS, k] (contiguous, 16-byte aligned: a kernel per alignment) @ W.T -> [m, n] in
        x's dtype."""
        m = x.shape[0]
        if (x.dim() != 2 or x.shape[1] != self.k or not 1 < m <= MATVEC_ROWS or x.device != self.q.device
                or x.dtype not in X_DTYPES):
            raise ValueError(f"x must be a float32/bf16/f16 tensor [2-{MATVEC_ROWS}, {self.k}] on {self.q.device}, "
                             f"got {x.dtype} {tuple(x.shape)} on {x.device}")
        x = x if x.is_contiguous() and x.data_ptr() % 16 == 0 else x.clone()
        rounded, t = RoundedRows.of(x), self.tiles
        y = torch.empty(m, self.n, dtype=x.dtype, device=x.device)
        out = y if t.parts == 1 else torch.empty(t.parts, MATVEC_ROWS, self.n, dtype=torch.float32, device=x.device)
        _unpacked_kernel[(triton.cdiv(self.n, t.rows), t.parts)](
            self.q, self.scales, self.d, *rounded.planes(), rounded.scale, out, m, self.n, self.k,
            self.k // BLOCK // t.parts, R=t.rows, num_warps=t.warps, num_stages=t.stages, **pdl.launch(x.device))
        if t.parts > 1:
            block = 1024
            _add_parts[(triton.cdiv(m * self.n, block),)](out, y, m, self.n, PARTS=t.parts, BLOCK=block,
                                                          **pdl.launch(x.device))
        return y


UNPACKED_TYPES = (Q.Q6_K,)
