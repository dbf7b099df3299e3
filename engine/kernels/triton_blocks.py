"""Triton kernels over GGUF blocks: Q8_0, Q4_0, Q4_K, Q5_K and Q6_K matrices kept as the file's bytes,
uint8 `[rows, row_bytes]` (the layout `BlockLinear` keeps), read and dequantized in registers only.

- `Matrix.dequantize`: rows of W as float32, bf16 or f16; the float32 values are gguf-py's bit for bit.
- `Matrix.matvec`: x [m <= 8, k] @ W.T for decode windows; float32 accumulation; x bf16, f16 or float32,
  y in x's dtype. One row (every decode row in exact mode) has a kernel of its own: it sums elementwise
  and reduces once. Q4_K and Q6_K (most of a Q4_K_M file) take x rounded to int16 per 32 values
  (`triton_xq`) and sum weights and x in int32 two at a time (dp2a), a 16-byte chunk of blocks a
  thread (in two halves, `_halves`, so that its sums stay in the thread), one reduction at the end, for
  one row and for 2-8 (`_rounded_kernel`, each program reading its weight rows once for all m rows). The
  Q6_K head's 2-8 rows take the tensor cores instead (`_mma_kernel`): the same integer sums as int8
  products, x split into two int8 planes, the weights' int8 values made four bytes a word in PTX (`_q6k_runs`,
  `_nibbles`), as do Q4_K and Q8_0 matrices below head size (`mma_tiles`). The other
  types' windows of 2-8 rows (and the Q8_0 head's) take the GEMM below with tiles
  of 16 rows of x (`Tiles.small_*`): on an H200 3.3x the float matvec they replaced (Q8_0 5120x2048 at 8
  rows: 62.2 -> 18.9 us).
- `Matrix.gemm`: x [m, k] @ W.T for prompt chunks: each weight tile is dequantized in registers to x's
  dtype (bf16 for the engine) and multiplied with tl.dot, float32 accumulation.
- `Matrix.matmul`: the matvec up to `MATVEC_ROWS` rows, the GEMM above.

Every kernel sees a weight row as groups of 16 or 32 values sharing a scale (and, in Q4_K/Q5_K, a min):
w = q * scale - min, computed in float32 as gguf-py does (`_group` knows where each type keeps them).

Deterministic by construction: no atomics; each output is reduced over k in one order, set by the tile
sizes (`Tiles`, `MmaTiles`), which are chosen from the matrix's shape only, never from m (where the
tensor-core kernel cuts k into parts, `_add_parts` adds them in order).
Batch invariance, within each path: every call of a matrix runs one compiled kernel (m is not
specialized; x is copied when its rows do not start 16-byte aligned). In the int16 matvec of 2-8 rows,
row i of y runs the same instructions whatever m is (rows past m are skipped by a uniform branch); on the
tensor cores its sums are exact integers and the floats after them elementwise; in the GEMM, row i is the
same dots over the same tiles whatever place it has in its tile (the tensor cores' sums do not depend on
it). So y[i] does not depend on how many rows x has. The paths (one row,
2-8 rows, prompt chunks) round differently from each other, as the CPU's matvec and slab GEMM do:
exact mode runs every decode row alone, so its rows always take the one-row kernel.

`python -m engine.kernels.triton_blocks` prints, per type, the matvec's GB/s at m=1 and m=8 and the
GEMM's TFLOP/s at m=512 (CUDA).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from engine.kernels import pdl
from engine.kernels.gpu import FLOAT_BLOCKS, FLOAT_DTYPE, MATVEC_ROWS, SUPPORTED
from engine.kernels.triton_xq import ASM, RoundedRows, _dp2a, _dp4a, _planes_of

SMALL_M = 16  # rows of x a GEMM tile holds for a window of 2-8 rows (tl.dot's smallest)
GROUP = {qtype: 16 if qtype == Q.Q6_K else 32 for qtype in SUPPORTED + FLOAT_BLOCKS}  # values per scale
X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FUSED = dict(enable_fp_fusion=True)  # fused multiply-adds in the products (Triton's default is changing)

_Q8_0 = tl.constexpr(int(Q.Q8_0))
_Q4_0 = tl.constexpr(int(Q.Q4_0))
_Q4_K = tl.constexpr(int(Q.Q4_K))
_Q5_K = tl.constexpr(int(Q.Q5_K))
_Q6_K = tl.constexpr(int(Q.Q6_K))
_F16 = tl.constexpr(int(Q.F16))
_BF16 = tl.constexpr(int(Q.BF16))
ROUNDED = (Q.Q4_K, Q.Q6_K)  # types whose decode sums take x rounded to int16 (`triton_xq`)
TENSOR_CORES = ROUNDED + (Q.Q8_0,)  # types with int8 tensor-core sums for 2-8 rows (`_mma_sums`), x rounded too
MMA_STEP = 256  # values of k a tensor-core step takes (`_mma_sums`' b0, b1)


def takes_tensor_cores(qtype: Q, k: int) -> bool:
    """Whether products of `qtype` over k values can take the tensor-core sums: k in whole steps (a Q8_0 matrix or
    stack of other k keeps its float sums)."""
    return qtype in TENSOR_CORES and k % MMA_STEP == 0


def steps_per_part(qtype: Q, k: int, parts: int) -> int:
    """The tensor-core steps of each of `parts` programs over k (`MMA_STEP` values a step); refused where
    products of `qtype` over k cannot take the tensor cores in that many parts."""
    if not takes_tensor_cores(qtype, k) or (k // MMA_STEP) % parts:
        raise ValueError(f"k={k} is not {parts} parts of whole {MMA_STEP}-value steps")
    return k // MMA_STEP // parts


@triton.jit
def _byte(w, at, mask):
    return tl.load(w + at, mask=mask, other=0).to(tl.int32)


@triton.jit
def _signed(w, at, mask):
    return tl.load(w + at, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)


@triton.jit
def _f16_bits(bits):
    """float16 bits (an int holding 16 of them) as float32."""
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _f16(w, at, mask):
    """The little-endian float16 at byte `at`, as float32."""
    return _f16_bits(_byte(w, at, mask) | (_byte(w, at + 1, mask) << 8))


@triton.jit
def _k_scales(w, blk, j, mask):
    """Q4_K/Q5_K: sub-block j's (0..7) scale and min: d and dmin times 6-bit values packed in 12 bytes."""
    a = _byte(w, blk + 4 + j, mask)
    b = _byte(w, blk + 8 + j, mask)
    c = _byte(w, blk + 4 + j % 4, mask)
    low = j < 4
    sc = tl.where(low, a & 63, (b & 15) | ((c >> 6) << 4))
    mn = tl.where(low, b & 63, (b >> 4) | ((a >> 6) << 4))
    return _f16(w, blk, mask) * sc.to(tl.float32), _f16(w, blk + 2, mask) * mn.to(tl.float32)


@triton.jit
def _group(w, row, g, i, mask, QTYPE: tl.constexpr):
    """Groups g [1, G, 1] of the weight rows starting at bytes `row` [R, 1, 1], values i [1, 1, GROUP]:
    float32 q [R, G, GROUP], scale [R, G, 1] and min ([R, G, 1], or 0.0) with w = q * scale - min."""
    if QTYPE == _F16 or QTYPE == _BF16:  # a 16-bit float each, in groups of 32: q is the value, no scale
        if QTYPE == _F16:
            values = w.to(tl.pointer_type(tl.float16))
        else:
            values = w.to(tl.pointer_type(tl.bfloat16))
        q = tl.load(values + row // 2 + g * 32 + i, mask=mask, other=0.0)
        scale = 1.0
        minimum = 0.0
    elif QTYPE == _Q8_0:  # 34 bytes: d, 32 int8
        blk = row + g * 34
        q = _signed(w, blk + 2 + i, mask)
        scale = _f16(w, blk, mask)
        minimum = 0.0
    elif QTYPE == _Q4_0:  # 18 bytes: d, 16 bytes whose low nibbles are values 0-15, high ones 16-31
        blk = row + g * 18
        q = ((_byte(w, blk + 2 + i % 16, mask) >> (i // 16 * 4)) & 15) - 8
        scale = _f16(w, blk, mask)
        minimum = 0.0
    elif QTYPE == _Q4_K:  # 144 bytes per 8 groups: d, dmin, 12 bytes of scales, 4 x 32 bytes of nibble pairs
        blk = row + g // 8 * 144
        j = g % 8
        scale, minimum = _k_scales(w, blk, j, mask)
        q = (_byte(w, blk + 16 + j // 2 * 32 + i, mask) >> (j % 2 * 4)) & 15
    elif QTYPE == _Q5_K:  # 176 bytes per 8 groups: as Q4_K, with 32 bytes of fifth bits before the nibbles
        blk = row + g // 8 * 176
        j = g % 8
        scale, minimum = _k_scales(w, blk, j, mask)
        low = (_byte(w, blk + 48 + j // 2 * 32 + i, mask) >> (j % 2 * 4)) & 15
        q = low | (((_byte(w, blk + 16 + i, mask) >> j) & 1) << 4)
    else:  # Q6_K, 210 bytes per 16 groups: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d
        blk = row + g // 16 * 210
        h = g % 16
        s = h // 2  # the 32 values whose bits share bytes
        at = h % 2 * 16 + i
        low = (_byte(w, blk + s // 4 * 64 + s % 2 * 32 + at, mask) >> (s // 2 % 2 * 4)) & 15
        high = (_byte(w, blk + 128 + s // 4 * 32 + at, mask) >> (s % 4 * 2)) & 3
        q = (low | (high << 4)) - 32
        scale = _f16(w, blk + 208, mask) * _signed(w, blk + 192 + h, mask)
        minimum = 0.0
    return q.to(tl.float32), scale, minimum


@triton.jit
def _partial(q, scale, minimum, xj, HAS_MIN: tl.constexpr):
    """[R]: the dot of each weight row's groups q [R, G, GROUP] (with their scales and mins) with x's values
    xj [1, G, GROUP], in one order. One scale per group: multiplied into the group's dot, not into each
    weight."""
    part = scale * tl.sum(q * xj, axis=2)[:, :, None]
    if HAS_MIN:
        part -= minimum * tl.sum(xj, axis=2)[:, :, None]
    return tl.sum(tl.sum(part, axis=2), axis=1)


@triton.jit
def _dequantize_kernel(w, y, n, k, row_bytes, QTYPE: tl.constexpr, GROUP: tl.constexpr, R: tl.constexpr,
                       BK: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)
    rows = tl.program_id(0) * R + tl.arange(0, R)
    g = tl.program_id(1) * (BK // GROUP) + tl.arange(0, BK // GROUP)[None, :, None]
    i = tl.arange(0, GROUP)[None, None, :]
    live = (rows[:, None, None] < n) & (g < k // GROUP)
    row = rows.to(tl.int64)[:, None, None]
    q, scale, minimum = _group(w, row * row_bytes, g, i, live, QTYPE)
    tl.store(y + row * k + g * GROUP + i, (q * scale - minimum).to(y.dtype.element_ty), mask=live)


@triton.jit
def _row_dot(w, rows, n, x_at, k, row_bytes, QTYPE: tl.constexpr, GROUP: tl.constexpr, R: tl.constexpr,
             BK: tl.constexpr):
    """[R] float32: weight rows `rows` times the x row at `x_at`, each product accumulated where it lands
    and reduced once at the end (a reduction per step is what bounds the matvec of 2-8 rows at one)."""
    row = rows.to(tl.int64)[:, None, None] * row_bytes
    g_step = tl.arange(0, BK // GROUP)[None, :, None]
    i = tl.arange(0, GROUP)[None, None, :]
    groups = k // GROUP
    acc = tl.zeros((R, BK // GROUP, GROUP), dtype=tl.float32)
    for e0 in range(0, k, BK):
        g = e0 // GROUP + g_step
        q, scale, minimum = _group(w, row, g, i, (rows[:, None, None] < n) & (g < groups), QTYPE)
        xj = tl.load(x_at + g * GROUP + i, mask=g < groups, other=0.0).to(tl.float32)
        acc += (q * scale - minimum) * xj
    return tl.sum(tl.sum(acc, axis=2), axis=1)


@triton.jit
def _row_kernel(w, x, y, n, k, row_bytes, QTYPE: tl.constexpr, GROUP: tl.constexpr, R: tl.constexpr,
                BK: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)
    rows = tl.program_id(0) * R + tl.arange(0, R)
    acc = _row_dot(w, rows, n, x, k, row_bytes, QTYPE, GROUP, R, BK)
    tl.store(y + rows, acc.to(y.dtype.element_ty), mask=rows < n)


@triton.jit
def _q4k_step(w, row, rows4, n, s0, blocks, R: tl.constexpr, SB: tl.constexpr):
    """One step of the Q4_K int16 sums: blocks s0.. of the weight rows at word offsets `row`. Returns the
    chunks' low and high nibbles (each two halves of two words, [R, SB, 8, 2]), their groups' float scales
    and minimums ([R, SB, 8, 1] each, low group then high group) and the step's first group index g
    [1, SB, 8, 1]. A thread takes 16 bytes of nibble pairs (chunk c of a block): 16 values of group 2p in
    their low nibbles, 16 of group 2p + 1 in their high ones (p = c // 2)."""
    words = w.to(tl.pointer_type(tl.int32))
    s = tl.arange(0, SB)[None, :, None, None]
    c = tl.arange(0, 8)[None, None, :, None]
    v = tl.arange(0, 2)[None, None, None, :]
    sb = s0 + s
    live = (rows4 < n) & (sb < blocks)
    blk = row + sb * 36  # 144 bytes: d and dmin, 12 bytes of scales, 128 of nibble pairs
    qa = tl.load(words + blk + 4 + c * 4 + v, mask=live, other=0)
    qb = tl.load(words + blk + 6 + c * 4 + v, mask=live, other=0)
    shift = (c // 2 % 2) * 16  # groups 2p and 2p + 1: bytes 2p % 4 and 2p % 4 + 1 of their scale words
    high = c >= 4  # groups 4-7 keep their scales' top bits in the first two words
    head = blk + c * 0
    dd = tl.load(words + head, mask=live, other=0)
    w1 = tl.load(words + head + 1, mask=live, other=0) >> shift
    w2 = tl.load(words + head + 2, mask=live, other=0) >> shift
    w3 = tl.load(words + head + 3, mask=live, other=0) >> shift
    d = _f16_bits(dd & 0xFFFF)
    dmin = _f16_bits((dd >> 16) & 0xFFFF)
    sc_lo = d * tl.where(high, (w3 & 15) | ((w1 >> 2) & 48), w1 & 63).to(tl.float32)
    sc_hi = d * tl.where(high, ((w3 >> 8) & 15) | ((w1 >> 10) & 48), (w1 >> 8) & 63).to(tl.float32)
    mn_lo = dmin * tl.where(high, ((w3 >> 4) & 15) | ((w2 >> 2) & 48), w2 & 63).to(tl.float32)
    mn_hi = dmin * tl.where(high, ((w3 >> 12) & 15) | ((w2 >> 10) & 48), (w2 >> 8) & 63).to(tl.float32)
    return ((qa & 0x0F0F0F0F, qb & 0x0F0F0F0F), ((qa >> 4) & 0x0F0F0F0F, (qb >> 4) & 0x0F0F0F0F), sc_lo, sc_hi, mn_lo,
            mn_hi, sb * 8 + c // 2 * 2)


@triton.jit
def _q4k_x(g, xq, xs, xsum, blocks):
    """One x row rounded to int16, as a step's chunks (`_q4k_step`'s g) take it: the values under the low and
    high nibbles (4 a word, in the words' halves), their groups' scales, and the groups' sums (where the
    group's first chunk is)."""
    x4 = _quads(xq)
    sb = g // 8
    c = tl.arange(0, 8)[None, None, :, None]
    at = sb * 64 + c // 2 * 16 + c % 2 * 4 + tl.arange(0, 2)[None, None, None, :]
    live = g < blocks * 8
    whole = live & (c % 2 == 0)  # a group's halves are two chunks: its minimum goes with the first
    return (_halves(x4, at, sb < blocks), _halves(x4, at + 8, sb < blocks),
            tl.load(xs + g, mask=live, other=0.0), tl.load(xs + g + 1, mask=live, other=0.0),
            tl.load(xsum + g, mask=whole, other=0.0), tl.load(xsum + g + 1, mask=whole, other=0.0))


@triton.jit
def _halves(ptr, at, live):
    """A chunk as two halves of two elements, at..at + 1 and at + 2..at + 3 ([..., 2] offsets `at`). A chunk
    loaded whole as [..., 4] comes in two vector loads of x's int64 (16 bytes each) against one of a
    weight chunk's words, and Triton then spreads it over two threads and sums it with shuffles; halves
    stay in the thread that loads them."""
    return tl.load(ptr + at, mask=live, other=0), tl.load(ptr + at + 2, mask=live, other=0)


@triton.jit
def _quads(xq):
    """x rounded (`triton_xq`) as a pointer to its values 4 a load: int64 for int16 values, int32 for int8."""
    if xq.dtype.element_ty == tl.int8:
        out = xq.to(tl.pointer_type(tl.int32))
    else:
        out = xq.to(tl.pointer_type(tl.int64))
    return out


@triton.jit
def _chunk_dot(x, q, ASM: tl.constexpr, SIGNED: tl.constexpr = False):
    """[..., 1] int32: a chunk's weight bytes q (two halves of two words; unsigned, SIGNED: int8) times its x
    values x (two halves of two loads of 4 values, `_quads`): int16 values two at a time (dp2a), int8 four
    (dp4a)."""
    if x[0].dtype == tl.int32:
        dot = _dp4a(x[1], q[1], _dp4a(x[0], q[0], tl.zeros(q[0].shape, dtype=tl.int32), SIGNED, ASM), SIGNED, ASM)
    else:
        dot = _dp2a((x[0] >> 32).to(tl.int32), q[0], _dp2a(x[0].to(tl.int32), q[0],
                                                             tl.zeros(q[0].shape, dtype=tl.int32), False, ASM), True,
                    ASM)
        dot = _dp2a((x[1] >> 32).to(tl.int32), q[1], _dp2a(x[1].to(tl.int32), q[1], dot, False, ASM), True, ASM)
    return tl.sum(dot, axis=3, keep_dims=True)


@triton.jit
def _q4k_dot(lo, hi, sc_lo, sc_hi, mn_lo, mn_hi, x_lo, x_hi, s_lo, s_hi, m_lo, m_hi, ASM: tl.constexpr):
    """[R, SB, 8, 1] float32: a step's chunks (from `_q4k_step`) times one x row (from `_q4k_x`)."""
    part = sc_lo * (_chunk_dot(x_lo, lo, ASM).to(tl.float32) * s_lo)
    part += sc_hi * (_chunk_dot(x_hi, hi, ASM).to(tl.float32) * s_hi)
    part -= mn_lo * m_lo
    part -= mn_hi * m_hi
    return part


@triton.jit
def _q4k_part(lo, hi, sc_lo, sc_hi, mn_lo, mn_hi, g, xq, xs, xsum, blocks, ASM: tl.constexpr):
    """[R, SB, 8, 1] float32: a step's chunks (from `_q4k_step`) times one x row rounded to int16."""
    x_lo, x_hi, s_lo, s_hi, m_lo, m_hi = _q4k_x(g, xq, xs, xsum, blocks)
    return _q4k_dot(lo, hi, sc_lo, sc_hi, mn_lo, mn_hi, x_lo, x_hi, s_lo, s_hi, m_lo, m_hi, ASM)


@triton.jit
def _row_dot_q4k(w, rows, n, xq, xs, xsum, k, row_bytes, R: tl.constexpr, SB: tl.constexpr, ASM: tl.constexpr):
    """[R] float32: Q4_K weight rows `rows` times one x row rounded to int16 (`triton_xq`: values xq,
    group scales xs and sums xsum), summed in int32 two values at a time, scaled once per group."""
    rows4 = rows[:, None, None, None]
    row = rows4.to(tl.int64) * (row_bytes // 4)
    blocks = k // 256
    acc = tl.zeros((R, SB, 8, 1), dtype=tl.float32)
    for s0 in range(0, blocks, SB):
        lo, hi, sc_lo, sc_hi, mn_lo, mn_hi, g = _q4k_step(w, row, rows4, n, s0, blocks, R, SB)
        acc += _q4k_part(lo, hi, sc_lo, sc_hi, mn_lo, mn_hi, g, xq, xs, xsum, blocks, ASM)
    return tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=1)


@triton.jit
def _row_dot2_q4k(w, w2, rows, n, xq, xs, xsum, k, row_bytes, R: tl.constexpr, SB: tl.constexpr, ASM: tl.constexpr):
    """`_row_dot_q4k` of two Q4_K matrices of one shape (a layer's gates and ups) in one pass over the blocks:
    both matrices' loads in flight together, each x chunk loaded once for both. Each matrix's sums are those
    `_row_dot_q4k` gives, bit for bit."""
    rows4 = rows[:, None, None, None]
    row = rows4.to(tl.int64) * (row_bytes // 4)
    blocks = k // 256
    acc = tl.zeros((R, SB, 8, 1), dtype=tl.float32)
    acc2 = tl.zeros((R, SB, 8, 1), dtype=tl.float32)
    for s0 in range(0, blocks, SB):
        lo, hi, sc_lo, sc_hi, mn_lo, mn_hi, g = _q4k_step(w, row, rows4, n, s0, blocks, R, SB)
        lo2, hi2, sc_lo2, sc_hi2, mn_lo2, mn_hi2, _ = _q4k_step(w2, row, rows4, n, s0, blocks, R, SB)
        x_lo, x_hi, s_lo, s_hi, m_lo, m_hi = _q4k_x(g, xq, xs, xsum, blocks)
        acc += _q4k_dot(lo, hi, sc_lo, sc_hi, mn_lo, mn_hi, x_lo, x_hi, s_lo, s_hi, m_lo, m_hi, ASM)
        acc2 += _q4k_dot(lo2, hi2, sc_lo2, sc_hi2, mn_lo2, mn_hi2, x_lo, x_hi, s_lo, s_hi, m_lo, m_hi, ASM)
    return tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=1), tl.sum(tl.sum(tl.sum(acc2, axis=3), axis=2), axis=1)


@triton.jit
def _word(w16, at, live):
    """The little-endian 32-bit words at int16 offsets `at` of a 2-byte aligned buffer: two 16-bit loads."""
    return ((tl.load(w16 + at, mask=live, other=0).to(tl.int32) & 0xFFFF)
            | (tl.load(w16 + at + 1, mask=live, other=0).to(tl.int32) << 16))


@triton.jit
def _words(w16, at, live):
    """A 16-byte chunk of a 2-byte aligned buffer (Q6_K's blocks of 210 bytes are only that) whose first two
    words start at int16 offsets `at` [..., 2], as `_halves`' two halves of two words."""
    return _word(w16, at, live), _word(w16, at + 4, live)


@triton.jit
def _six_bits(ql, qh, NIBBLE: tl.constexpr, PAIR: tl.constexpr):
    """Q6_K values, 4 a word: the low (NIBBLE 0) or high (4) nibbles of ql under the bit pairs at PAIR of qh."""
    return ((ql >> NIBBLE) & 0x0F0F0F0F) | (((qh >> PAIR) & 0x03030303) << 4)


@triton.jit
def _q6k_step(w, row, rows4, n, s0, blocks, R: tl.constexpr, SB: tl.constexpr):
    """One step of the Q6_K int16 sums: blocks s0.. of the weight rows at int16 offsets `row`. A thread
    takes chunk c of a block: half h = c // 2 of it, values l = 16i..16i+15 (i = c % 2) of that half's four
    runs of 32 (scales 2r + i): 16 bytes of qh and twice 16 of ql, as 4 words each. Returns the four
    runs' 6-bit values as bytes of words (each two halves of two words, [R, SB, 4, 2], as `_halves`) and
    their scales times d ([R, SB, 4, 1])."""
    w16 = w.to(tl.pointer_type(tl.int16))
    s = tl.arange(0, SB)[None, :, None, None]
    c = tl.arange(0, 4)[None, None, :, None]
    u = tl.arange(0, 2)[None, None, None, :]
    h, i = c // 2, c % 2
    sb = s0 + s
    live = (rows4 < n) & (sb < blocks)
    blk = row + sb * 105  # 210 bytes: ql[128], qh[64], 16 int8 scales, d
    ql0 = _words(w16, blk + h * 32 + i * 8 + u * 2, live)
    ql1 = _words(w16, blk + h * 32 + 16 + i * 8 + u * 2, live)
    qh = _words(w16, blk + 64 + h * 16 + i * 8 + u * 2, live)
    d = _f16_bits(tl.load(w16 + blk + 104 + c * 0, mask=live, other=0).to(tl.int32) & 0xFFFF)
    scales = w + (blk * 2 + 192 + h * 8 + i)  # run r's scale at + 2r
    q0 = (_six_bits(ql0[0], qh[0], 0, 0), _six_bits(ql0[1], qh[1], 0, 0))
    q1 = (_six_bits(ql1[0], qh[0], 0, 2), _six_bits(ql1[1], qh[1], 0, 2))
    q2 = (_six_bits(ql0[0], qh[0], 4, 4), _six_bits(ql0[1], qh[1], 4, 4))
    q3 = (_six_bits(ql1[0], qh[0], 4, 6), _six_bits(ql1[1], qh[1], 4, 6))
    d0 = d * tl.load(scales, mask=live, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    d1 = d * tl.load(scales + 2, mask=live, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    d2 = d * tl.load(scales + 4, mask=live, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    d3 = d * tl.load(scales + 6, mask=live, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    return q0, q1, q2, q3, d0, d1, d2, d3, sb


@triton.jit
def _q6k_run(q, dr, r: tl.constexpr, sb, xq, xs, halves, blocks, ASM: tl.constexpr):
    """[R, SB, 4, 1] float32: run r of a step's chunks (`_q6k_step`) times one x row rounded to int16; the
    offset of 32 comes off in integers (32 times the x values' sum, `halves`)."""
    x4 = _quads(xq)
    c = tl.arange(0, 4)[None, None, :, None]
    h, i = c // 2, c % 2
    xlive = sb < blocks
    xr = _halves(x4, sb * 64 + h * 32 + r * 8 + i * 4 + tl.arange(0, 2)[None, None, None, :], xlive)
    dot = _chunk_dot(xr, q, ASM) - 32 * tl.load(halves + sb * 16 + h * 8 + r * 2 + i, mask=xlive, other=0)
    return dr * (dot.to(tl.float32) * tl.load(xs + sb * 8 + h * 4 + r, mask=xlive, other=0.0))


@triton.jit
def _q6k_part(q0, q1, q2, q3, d0, d1, d2, d3, sb, xq, xs, halves, blocks, ASM: tl.constexpr):
    part = _q6k_run(q0, d0, 0, sb, xq, xs, halves, blocks, ASM)
    part += _q6k_run(q1, d1, 1, sb, xq, xs, halves, blocks, ASM)
    part += _q6k_run(q2, d2, 2, sb, xq, xs, halves, blocks, ASM)
    part += _q6k_run(q3, d3, 3, sb, xq, xs, halves, blocks, ASM)
    return part


@triton.jit
def _row_dot_q6k(w, rows, n, xq, xs, halves, k, row_bytes, R: tl.constexpr, SB: tl.constexpr, ASM: tl.constexpr):
    """[R] float32: Q6_K weight rows `rows` times one x row rounded to int16 (`triton_xq`: values xq, group
    scales xs, int32 sums of each 16 values `halves`), summed two values at a time (dp2a)."""
    rows4 = rows[:, None, None, None]
    row = rows4.to(tl.int64) * (row_bytes // 2)
    blocks = k // 256
    acc = tl.zeros((R, SB, 4, 1), dtype=tl.float32)
    for s0 in range(0, blocks, SB):
        q0, q1, q2, q3, d0, d1, d2, d3, sb = _q6k_step(w, row, rows4, n, s0, blocks, R, SB)
        acc += _q6k_part(q0, q1, q2, q3, d0, d1, d2, d3, sb, xq, xs, halves, blocks, ASM)
    return tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=1)


@triton.jit
def _x_row(src, j, RUN: tl.constexpr):
    """The x row of a call's j-th row: src[j] (RUN: a fused MoE run's pairs), else j."""
    if RUN:
        at = tl.load(src + j).to(tl.int64)
    else:
        at = j
    return at


@triton.jit
def _sums(ROWS: tl.constexpr, R: tl.constexpr, SB: tl.constexpr, C: tl.constexpr, EACH_STEP: tl.constexpr):
    """Zeroed sums of ROWS x rows times R weight rows: reduced to [ROWS, R] every step (EACH_STEP: fewer
    registers, the MoE runs' choice; kept to the end, an H100's 8-row Q4_K gate+up took 36.5 -> 42.7 us on 8
    experts and the Q4_K_M mix decoded 8 rows 4% slower) or kept [ROWS, R, SB, C, 1] where each chunk's sums land
    until the end (the dense products': fewer instructions)."""
    if EACH_STEP:
        acc = tl.zeros((ROWS, R), dtype=tl.float32)
    else:
        acc = tl.zeros((ROWS, R, SB, C, 1), dtype=tl.float32)
    return acc


@triton.jit
def _sums_add(acc, part, j, ROWS: tl.constexpr, EACH_STEP: tl.constexpr):
    """`acc` with a step's sums `part` [R, SB, C, 1] added to x row j's."""
    if EACH_STEP:
        j2 = tl.arange(0, ROWS)[:, None]
        acc = tl.where(j2 == j, acc + tl.sum(tl.sum(tl.sum(part, axis=3), axis=2), axis=1)[None, :], acc)
    else:
        j5 = tl.arange(0, ROWS)[:, None, None, None, None]
        acc = tl.where(j5 == j, acc + part[None], acc)
    return acc


@triton.jit
def _sums_total(acc, EACH_STEP: tl.constexpr):
    """[ROWS, R] float32: the sums `_sums` began."""
    if not EACH_STEP:
        acc = tl.sum(tl.sum(tl.sum(acc, axis=4), axis=3), axis=2)
    return acc


@triton.jit
def _rows_dot_q6k(w, rows, n, xq, xs, halves, src, count, k, b0, b1, row_bytes, R: tl.constexpr, SB: tl.constexpr,
                  ROWS: tl.constexpr, ASM: tl.constexpr, RUN: tl.constexpr):
    """[ROWS, R] float32: Q6_K weight rows `rows` times x rows src[0..count-1] (RUN; else rows 0..count-1) over
    blocks [b0, b1) of each row, as `_rows_dot_q4k` does for Q4_K."""
    rows4 = rows[:, None, None, None]
    row = rows4.to(tl.int64) * (row_bytes // 2)
    blocks = k // 256
    acc = _sums(ROWS, R, SB, 4, RUN)
    for s0 in range(b0, b1, SB):
        q0, q1, q2, q3, d0, d1, d2, d3, sb = _q6k_step(w, row, rows4, n, s0, blocks, R, SB)
        for j in tl.static_range(ROWS):
            if j < count:
                at = _x_row(src, j, RUN)
                part = _q6k_part(q0, q1, q2, q3, d0, d1, d2, d3, sb, xq + at * k, xs + at * (k // 32),
                                 halves + at * (k // 16), blocks, ASM)
                acc = _sums_add(acc, part, j, ROWS, RUN)
    return _sums_total(acc, RUN)


@triton.jit
def _rows_dot_q4k(w, rows, n, xq, xs, xsum, src, count, k, b0, b1, row_bytes, R: tl.constexpr, SB: tl.constexpr,
                  ROWS: tl.constexpr, ASM: tl.constexpr, RUN: tl.constexpr):
    """[ROWS, R] float32: Q4_K weight rows `rows` times x rows src[0..count-1] (RUN: a fused MoE run's pairs,
    their sums reduced every step; else rows 0..count-1 of a dense product, sums kept to the end: `_sums`),
    count <= ROWS, rounded to int16, over blocks [b0, b1) of each row (a part of k; all of them: 0, k // 256):
    each weight chunk is read once for all the x rows, and row j runs the same instructions whatever `count` is
    (rows past it skipped by a uniform branch)."""
    rows4 = rows[:, None, None, None]
    row = rows4.to(tl.int64) * (row_bytes // 4)
    blocks = k // 256
    acc = _sums(ROWS, R, SB, 8, RUN)
    for s0 in range(b0, b1, SB):
        lo, hi, sc_lo, sc_hi, mn_lo, mn_hi, g = _q4k_step(w, row, rows4, n, s0, blocks, R, SB)
        for j in tl.static_range(ROWS):
            if j < count:
                at = _x_row(src, j, RUN)
                part = _q4k_part(lo, hi, sc_lo, sc_hi, mn_lo, mn_hi, g, xq + at * k, xs + at * (k // 32),
                                 xsum + at * (k // 32), blocks, ASM)
                acc = _sums_add(acc, part, j, ROWS, RUN)
    return _sums_total(acc, RUN)


@triton.jit
def _rows_dot2_q4k(w, w2, rows, n, xq, xs, xsum, src, count, k, b0, b1, row_bytes, R: tl.constexpr, SB: tl.constexpr,
                   ROWS: tl.constexpr, ASM: tl.constexpr):
    """`_rows_dot_q4k` of two Q4_K matrices of one shape (a layer's gates and ups) over the same x rows
    src[0..count-1] and blocks [b0, b1), in one pass over the blocks: each x chunk is loaded once for both. Each
    matrix's sums are those `_rows_dot_q4k` gives for a run, bit for bit."""
    rows4 = rows[:, None, None, None]
    row = rows4.to(tl.int64) * (row_bytes // 4)
    blocks = k // 256
    acc = _sums(ROWS, R, SB, 8, True)
    acc2 = _sums(ROWS, R, SB, 8, True)
    for s0 in range(b0, b1, SB):
        lo, hi, sc_lo, sc_hi, mn_lo, mn_hi, g = _q4k_step(w, row, rows4, n, s0, blocks, R, SB)
        lo2, hi2, sc_lo2, sc_hi2, mn_lo2, mn_hi2, _ = _q4k_step(w2, row, rows4, n, s0, blocks, R, SB)
        for j in tl.static_range(ROWS):
            if j < count:
                at = _x_row(src, j, True)
                x_lo, x_hi, s_lo, s_hi, m_lo, m_hi = _q4k_x(g, xq + at * k, xs + at * (k // 32), xsum + at * (k // 32),
                                                          blocks)
                part = _q4k_dot(lo, hi, sc_lo, sc_hi, mn_lo, mn_hi, x_lo, x_hi, s_lo, s_hi, m_lo, m_hi, ASM)
                acc = _sums_add(acc, part, j, ROWS, True)
                part = _q4k_dot(lo2, hi2, sc_lo2, sc_hi2, mn_lo2, mn_hi2, x_lo, x_hi, s_lo, s_hi, m_lo, m_hi, ASM)
                acc2 = _sums_add(acc2, part, j, ROWS, True)
    return acc, acc2


@triton.jit
def _q8_0_step(w, row, rows4, n, s0, blocks, NB: tl.constexpr):
    """One step of Q8_0's int8 sums: blocks s0..s0+NB-1 of the weight rows at int16 offsets `row`. A thread takes
    half a block, 16 values (chunk c), as two halves of two words (`_words`: 34-byte blocks are only 2-byte
    aligned). Returns them [R, NB, 2, 2] each, the blocks' scales d [R, NB, 1, 1] and their indices b."""
    w16 = w.to(tl.pointer_type(tl.int16))
    b = s0 + tl.arange(0, NB)[None, :, None, None]
    c = tl.arange(0, 2)[None, None, :, None]
    u = tl.arange(0, 2)[None, None, None, :]
    live = (rows4 < n) & (b < blocks)
    blk = row + b * 17  # 34 bytes: d, then 32 int8
    q = _words(w16, blk + 1 + c * 8 + u * 2, live)
    d = _f16_bits(tl.load(w16 + blk, mask=live, other=0).to(tl.int32) & 0xFFFF)
    return q, d, b


@triton.jit
def _q8_0_part(q, d, b, xq, xs, blocks, ASM: tl.constexpr):
    """[R, NB, 2, 1] float32: a step's chunks (`_q8_0_step`) times one x row rounded to int8, four values an
    instruction (dp4a, both signed); a block is one group of x, so one scale each."""
    live = b < blocks
    x = _halves(_quads(xq), b * 8 + tl.arange(0, 2)[None, None, :, None] * 4 + tl.arange(0, 2)[None, None, None, :],
                live)
    return d * (_chunk_dot(x, q, ASM, True).to(tl.float32) * tl.load(xs + b, mask=live, other=0.0))


@triton.jit
def _row_dot_q8_0(w, rows, n, xq, xs, k, row_bytes, R: tl.constexpr, NB: tl.constexpr, ASM: tl.constexpr):
    """[R] float32: Q8_0 weight rows `rows` times one x row rounded to int8 (`triton_xq`: values xq, group
    scales xs), NB blocks a step."""
    rows4 = rows[:, None, None, None]
    row = rows4.to(tl.int64) * (row_bytes // 2)
    blocks = k // 32
    acc = tl.zeros((R, NB, 2, 1), dtype=tl.float32)
    for s0 in range(0, blocks, NB):
        q, d, b = _q8_0_step(w, row, rows4, n, s0, blocks, NB)
        acc += _q8_0_part(q, d, b, xq, xs, blocks, ASM)
    return tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=1)


@triton.jit
def _rows_dot_q8_0(w, rows, n, xq, xs, src, count, k, row_bytes, R: tl.constexpr, NB: tl.constexpr,
                   ROWS: tl.constexpr, ASM: tl.constexpr):
    """[ROWS, R] float32: Q8_0 weight rows `rows` times x rows src[0..count-1] rounded to int8 (a fused MoE run's
    pairs, their sums reduced every step), over all of k, as `_rows_dot_q4k` does for Q4_K."""
    rows4 = rows[:, None, None, None]
    row = rows4.to(tl.int64) * (row_bytes // 2)
    blocks = k // 32
    acc = _sums(ROWS, R, NB, 2, True)
    for s0 in range(0, blocks, NB):
        q, d, b = _q8_0_step(w, row, rows4, n, s0, blocks, NB)
        for j in tl.static_range(ROWS):
            if j < count:
                at = _x_row(src, j, True)
                acc = _sums_add(acc, _q8_0_part(q, d, b, xq + at * k, xs + at * (k // 32), blocks, ASM), j, ROWS,
                                True)
    return acc


@triton.jit(do_not_specialize=["m"])  # one compiled kernel for every m
def _rounded_kernel(w, xq, xs, xsum, halves, y, m, n, k, row_bytes, QTYPE: tl.constexpr, R: tl.constexpr,
                    SB: tl.constexpr, ROWS: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr):
    """y [m, n] for x rounded to int16: one row (ROWS 1) or 2-8 rows (ROWS `MATVEC_ROWS`), Q4_K or Q6_K. The
    rows' sums are kept until the end (`_sums`): reduced every step, the H200 took longer at 8 rows (Q4_K
    5120x2048 19.6 -> 26.3 us, the Q6_K head 402.3 -> 442.5)."""
    pdl.wait(PDL)
    rows = tl.program_id(0) * R + tl.arange(0, R)
    if ROWS == 1:
        if QTYPE == _Q4_K:
            one = _row_dot_q4k(w, rows, n, xq, xs, xsum, k, row_bytes, R, SB, ASM)
        else:
            one = _row_dot_q6k(w, rows, n, xq, xs, halves, k, row_bytes, R, SB, ASM)
        tl.store(y + rows, one.to(y.dtype.element_ty), mask=rows < n)
    else:
        if QTYPE == _Q4_K:
            acc = _rows_dot_q4k(w, rows, n, xq, xs, xsum, xq, m, k, 0, k // 256, row_bytes, R, SB, ROWS, ASM, False)
        else:
            acc = _rows_dot_q6k(w, rows, n, xq, xs, halves, xq, m, k, 0, k // 256, row_bytes, R, SB, ROWS, ASM, False)
        r = tl.arange(0, ROWS)[:, None]
        tl.store(y + r * n + rows[None, :], acc.to(y.dtype.element_ty), mask=(r < m) & (rows[None, :] < n))


@triton.jit
def _x_planes(x_hi, x_lo, at, live, PLANES: tl.constexpr):
    """[16, K] int8 planes hi, lo of x rounded to int16 at offsets `at` (0 where not `live`), x = 256 hi + lo + 128:
    loaded from `RoundedRows.planes` (PLANES), or split here from the int16 values at `x_hi` (`x_lo` unused)."""
    if PLANES:
        hi = tl.load(x_hi + at, mask=live, other=0)
        lo = tl.load(x_lo + at, mask=live, other=0)
    else:
        hi, lo = _planes_of(tl.load(x_hi + at, mask=live, other=0).to(tl.int32))
        lo = tl.where(live, lo, 0)
    return hi, lo


@triton.jit
def _int8_sums(w_q, x_hi, x_lo, live):
    """[R, 16] int32: weight values w_q [R, K] int8 times x rows given as planes (`_x_planes`, [16, K], 0 where not
    `live`) on the tensor cores, exactly: x . w is 256 (hi . w) + (lo . w) + 128 (live . w), three int8 products."""
    hi = tl.dot(w_q, tl.trans(x_hi), out_dtype=tl.int32)
    lo = tl.dot(w_q, tl.trans(x_lo), out_dtype=tl.int32)
    return hi * 256 + lo + tl.dot(w_q, tl.trans(live.to(tl.int8)), out_dtype=tl.int32) * 128


@triton.jit
def _nibbles(qs, ASM: tl.constexpr):
    """The low and high nibbles of bytes `qs` as int8; on a GPU in packed words: four bytes an instruction."""
    if ASM:
        low, high = tl.inline_asm_elementwise(
            "{ and.b32 $0, $2, 0x0F0F0F0F; shr.b32 $1, $2, 4; and.b32 $1, $1, 0x0F0F0F0F; }", "=r,=r,r", [qs],
            dtype=(tl.int8, tl.int8), is_pure=True, pack=4)
    else:
        low, high = (qs & 15).to(tl.int8), (qs >> 4).to(tl.int8)
    return low, high


@triton.jit
def _q4k_mma_step(w, blk, p, live_n, x_low, low, x_high, high, half, xsc, xsm, acc, ASM: tl.constexpr):
    """acc + the sums of bytes 32p.. of the Q4_K blocks at `blk` [R] (sub-blocks 2p and 2p + 1) with x's tiles."""
    c = tl.arange(0, 32)
    qs = tl.load(w + blk[:, None] + 16 + p * 32 + c[None, :], mask=live_n[:, None], other=0)
    low_q, high_q = _nibbles(qs, ASM)
    s = _int8_sums(low_q, x_low[0], x_low[1], low)
    s += _int8_sums(high_q, x_high[0], x_high[1], high)
    scale_low, min_low = _k_scales(w, blk, 2 * p, live_n)
    scale_high, min_high = _k_scales(w, blk, 2 * p + 1, live_n)
    scale = tl.where(half[None, :] == 0, scale_low[:, None], scale_high[:, None])
    minimum = tl.where(half[None, :] == 0, min_low[:, None], min_high[:, None])
    return acc + scale * (s.to(tl.float32) * xsc[None, :]) - minimum * xsm[None, :]


@triton.jit
def _q4k_mma(w, w2, row, live_n, x_hi, x_lo, xs, xsum, x_row, x_live, k, b0, b1, R: tl.constexpr,
             BOTH: tl.constexpr, PLANES: tl.constexpr, ASM: tl.constexpr):
    """[R, 16] float32 sums of the Q4_K weight rows at bytes `row` [R] of w (and, BOTH, of w2, a matrix of w's
    shape, from the same x tiles) over blocks [b0, b1) with the x rows `x_row` [16] (int64, `x_live`) on the
    tensor cores: tile row t holds x row x_row[t]'s values of each 32 bytes' low sub-block (t < 8) or high one
    (t >= 8), zeros elsewhere; `_halves_of` adds rows t and t + 8. The sums are the int16 kernel's integers; the
    floats after them are elementwise, so an x row's bits do not depend on the others."""
    t = tl.arange(0, 16)
    half = t // 8
    c = tl.arange(0, 32)
    low = x_live[:, None] & (half[:, None] == 0) & (c[None, :] >= 0)
    high = x_live[:, None] & (half[:, None] == 1) & (c[None, :] >= 0)
    x_at = x_row[:, None] * k + c[None, :]
    groups = x_row * (k // 32) + half
    acc = tl.zeros((R, 16), dtype=tl.float32)
    acc2 = tl.zeros((R, 16), dtype=tl.float32)
    for b in range(b0, b1):  # blocks: d, dmin, 12 bytes of scales and mins, qs[128]
        for p in range(4):  # not unrolled: unrolled, a one-warp MoE run held 255 registers and spilled (sm_90)
            at = x_at + b * 256 + p * 64
            x_low, x_high = _x_planes(x_hi, x_lo, at, low, PLANES), _x_planes(x_hi, x_lo, at + 32, high, PLANES)
            g = groups + b * 8 + 2 * p
            xsc = tl.load(xs + g, mask=x_live, other=0.0)
            xsm = tl.load(xsum + g, mask=x_live, other=0.0)
            acc = _q4k_mma_step(w, row + b * 144, p, live_n, x_low, low, x_high, high, half, xsc, xsm, acc, ASM)
            if BOTH:
                acc2 = _q4k_mma_step(w2, row + b * 144, p, live_n, x_low, low, x_high, high, half, xsc, xsm, acc2,
                                     ASM)
    return acc, acc2


def _q6k_run_ptx(r: int) -> str:
    """PTX for run r of a Q6_K half-block on four bytes a word, into $r from ql's slices $4 (even r), $5 (odd r)
    and qh $6: nibble r // 2 of ql, or qh's bits 2r moved to bits 4-5; then + 0x60 (a byte holds at most 63 + 96,
    so nothing carries into the next) and bit 7 flipped, which is the 6-bit value - 32 as int8."""
    ql = "$5" if r % 2 else "$4"
    nibble = f"shr.b32 t, {ql}, 4; and.b32 t, t, 0x0F0F0F0F; " if r // 2 else f"and.b32 t, {ql}, 0x0F0F0F0F; "
    bits = f"shl.b32 h, $6, {4 - 2 * r}; " if r < 2 else "mov.b32 h, $6; " if r == 2 else "shr.b32 h, $6, 2; "
    minus_32 = f"add.u32 t, t, 0x60606060; xor.b32 ${r}, t, 0x80808080; "
    return nibble + bits + "and.b32 h, h, 0x30303030; or.b32 t, t, h; " + minus_32


_Q6K_RUNS = tl.constexpr("{ .reg .b32 t, h; " + "".join(_q6k_run_ptx(r) for r in range(4)) + "}")


@triton.jit
def _q6k_runs(ql0, ql1, qh, ASM: tl.constexpr):
    """A Q6_K half-block's four runs of 32 int8 values (q - 32), each [R, 32]: run r = 2u + j holds nibble u of
    `ql0` (j 0) or `ql1` (j 1) and bits 2r of `qh` above it. On a GPU in packed words: four bytes an instruction."""
    if ASM:
        runs = tl.inline_asm_elementwise(_Q6K_RUNS, "=r,=r,=r,=r,r,r,r", [ql0, ql1, qh],
                                         dtype=(tl.int8, tl.int8, tl.int8, tl.int8), is_pure=True, pack=4)
    else:
        runs = ()
        for r in tl.static_range(4):
            ql = ql1 if r % 2 else ql0
            runs += ((((ql >> (4 * (r // 2))) & 15) | (((qh >> (2 * r)) & 3) << 4)).to(tl.int8) - 32,)
    return runs


@triton.jit
def _q6k_mma(w, row, live_n, x_hi, x_lo, xs, x_row, x_live, k, b0, b1, R: tl.constexpr, PLANES: tl.constexpr,
             ASM: tl.constexpr):
    """[R, 16] float32 sums of the Q6_K weight rows at bytes `row` [R] of w over blocks [b0, b1) with the x rows
    `x_row` [16] on the tensor cores (as `_q4k_mma`): each run of 32 values is one int8 product with a tile of
    16 x rows, row t holding x row x_row[t]'s first 16 values of the run (t < 8) or its last 16 (the run's two
    scales), zeros elsewhere."""
    t = tl.arange(0, 16)
    half = t // 8
    c = tl.arange(0, 32)
    live = x_live[:, None] & (c[None, :] // 16 == half[:, None])
    x_at = x_row[:, None] * k + c[None, :]
    acc = tl.zeros((R, 16), dtype=tl.float32)
    for b in range(b0, b1):
        blk = row + b * 210  # ql[128], qh[64], 16 int8 scales, d
        d = _f16(w, blk + 208, live_n)
        for h in tl.static_range(2):
            qh = tl.load(w + blk[:, None] + 128 + h * 32 + c[None, :], mask=live_n[:, None], other=0)
            ql0 = tl.load(w + blk[:, None] + h * 64 + c[None, :], mask=live_n[:, None], other=0)
            ql1 = tl.load(w + blk[:, None] + h * 64 + 32 + c[None, :], mask=live_n[:, None], other=0)
            runs = _q6k_runs(ql0, ql1, qh, ASM)
            for r in tl.static_range(4):  # run r of half h: values 128h + 32r.., scales 8h + 2r and 8h + 2r + 1
                x_t = _x_planes(x_hi, x_lo, x_at + b * 256 + h * 128 + r * 32, live, PLANES)
                s = _int8_sums(runs[r], x_t[0], x_t[1], live)
                first = _signed(w, blk + 192 + h * 8 + r * 2, live_n)
                second = _signed(w, blk + 193 + h * 8 + r * 2, live_n)
                scale = d[:, None] * tl.where(half[None, :] == 0, first[:, None], second[:, None])
                xsc = tl.load(xs + x_row * (k // 32) + b * 8 + h * 4 + r, mask=x_live, other=0.0)
                acc += scale * (s.to(tl.float32) * xsc[None, :])
    return acc


@triton.jit
def _q8_0_mma(w, row, live_n, x_hi, x_lo, xs, x_row, x_live, k, b0, b1, R: tl.constexpr, PLANES: tl.constexpr):
    """[R, 16] float32 sums of the Q8_0 weight rows at bytes `row` [R] of w over the 256 values [256 b0, 256 b1)
    with the x rows `x_row` [16] on the tensor cores (as `_q6k_mma`): two blocks' 64 values are one int8 product
    with a tile of 16 x rows, row t holding x row x_row[t]'s values of the first block (t < 8) or of the second
    (their two scales), zeros elsewhere."""
    t = tl.arange(0, 16)
    half = t // 8
    c = tl.arange(0, 64)
    live = x_live[:, None] & (c[None, :] // 32 == half[:, None])
    x_at = x_row[:, None] * k + c[None, :]
    at = (c // 32) * 34 + 2 + c % 32  # blocks: d, qs[32]
    acc = tl.zeros((R, 16), dtype=tl.float32)
    for b in range(b0, b1):
        for p in range(4):  # blocks 8b + 2p and 8b + 2p + 1
            blk = row + (b * 8 + p * 2) * 34
            q = tl.load(w + blk[:, None] + at[None, :], mask=live_n[:, None], other=0).to(tl.int8, bitcast=True)
            x_t = _x_planes(x_hi, x_lo, x_at + b * 256 + p * 64, live, PLANES)
            s = _int8_sums(q, x_t[0], x_t[1], live)
            scale = tl.where(half[None, :] == 0, _f16(w, blk, live_n)[:, None], _f16(w, blk + 34, live_n)[:, None])
            xsc = tl.load(xs + x_row * (k // 32) + b * 8 + p * 2 + half, mask=x_live, other=0.0)
            acc += scale * (s.to(tl.float32) * xsc[None, :])
    return acc


@triton.jit
def _mma_sums(w, row, live_n, x_hi, x_lo, xs, xsum, x_row, x_live, k, b0, b1, QTYPE: tl.constexpr, R: tl.constexpr,
              PLANES: tl.constexpr, ASM: tl.constexpr):
    """[R, 16] float32: `_q4k_mma`'s sums (Q4_K, one matrix), `_q6k_mma`'s (Q6_K) or `_q8_0_mma`'s (Q8_0)."""
    if QTYPE == _Q4_K:
        acc, _ = _q4k_mma(w, w, row, live_n, x_hi, x_lo, xs, xsum, x_row, x_live, k, b0, b1, R, False, PLANES, ASM)
    elif QTYPE == _Q6_K:
        acc = _q6k_mma(w, row, live_n, x_hi, x_lo, xs, x_row, x_live, k, b0, b1, R, PLANES, ASM)
    else:
        acc = _q8_0_mma(w, row, live_n, x_hi, x_lo, xs, x_row, x_live, k, b0, b1, R, PLANES)
    return acc


@triton.jit
def _halves_of(acc, R: tl.constexpr):
    """[8, R]: rows t and t + 8 of the tensor-core sums [R, 16] added (the two halves of x row t's values)."""
    return tl.sum(tl.reshape(tl.trans(acc), (2, 8, R)), axis=0)


@triton.jit(do_not_specialize=["m", "per"])  # one compiled kernel for every m
def _mma_kernel(w, x_hi, x_lo, xs, xsum, out, m, n, k, row_bytes, per, QTYPE: tl.constexpr, R: tl.constexpr,
                ASM: tl.constexpr, PDL: tl.constexpr):
    """Part s = program_id(1) of y [m <= 8, n] for x rounded to int16 (as planes), a `TENSOR_CORES` type, on
    the tensor cores: steps [s * per, (s + 1) * per) of 256 values of each weight row, into `out` (y itself for
    one part, else float32 [parts, 8, n]). Row i's bits do not depend on m."""
    pdl.wait(PDL)
    rows = tl.program_id(0) * R + tl.arange(0, R)
    part = tl.program_id(1)
    live_n = rows < n
    row = rows.to(tl.int64) * row_bytes
    x_row = tl.arange(0, 16) % 8
    acc = _mma_sums(w, row, live_n, x_hi, x_lo, xs, xsum, x_row.to(tl.int64), x_row < m, k, part * per,
                    (part + 1) * per, QTYPE, R, True, ASM)
    r8 = tl.arange(0, 8)[:, None]
    tl.store(out + part * 8 * n + r8 * n + rows[None, :], _halves_of(acc, R).to(out.dtype.element_ty),
             mask=(r8 < m) & live_n[None, :])


@triton.jit(do_not_specialize=["m"])
def _add_parts(parts, y, m, n, PARTS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """y [m, n] = parts[0] + parts[1] + ... in that order (parts float32 [PARTS, 8, n]), elementwise."""
    pdl.wait(PDL)
    at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = at < m * n
    total = tl.load(parts + at, mask=live, other=0.0)
    for s in tl.static_range(1, PARTS):
        total += tl.load(parts + s * 8 * n + at, mask=live, other=0.0)
    tl.store(y + at, total.to(y.dtype.element_ty), mask=live)


@triton.jit(do_not_specialize=["m"])  # one compiled kernel for every m
def _gemm_kernel(w, x, y, m, n, k, row_bytes, QTYPE: tl.constexpr, GROUP: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)
    xr = tl.program_id(0) * BM + tl.arange(0, BM)
    rows = tl.program_id(1) * BN + tl.arange(0, BN)
    row = rows.to(tl.int64)[:, None, None] * row_bytes
    g_step = tl.arange(0, BK // GROUP)[None, :, None]
    i = tl.arange(0, GROUP)[None, None, :]
    e_step = tl.arange(0, BK)[None, :]
    xp = x + xr.to(tl.int64)[:, None] * k
    groups = k // GROUP
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for e0 in range(0, k, BK):
        g = e0 // GROUP + g_step
        q, scale, minimum = _group(w, row, g, i, (rows[:, None, None] < n) & (g < groups), QTYPE)
        tile = tl.reshape(q * scale - minimum, (BN, BK)).to(x.dtype.element_ty)
        e = e0 + e_step
        xs = tl.load(xp + e, mask=(xr[:, None] < m) & (e < k), other=0.0)
        acc = tl.dot(xs, tl.trans(tile), acc)
    out = y + xr.to(tl.int64)[:, None] * n + rows[None, :]
    tl.store(out, acc.to(y.dtype.element_ty), mask=(xr[:, None] < m) & (rows[None, :] < n))


@dataclass(frozen=True)
class Tiles:
    """A matrix's tile sizes (powers of two), chosen from its shape only, so never from m: they fix
    every output's reduction order."""

    row_k: int  # values per step of the one-row kernel (one weight row per program)
    row_blocks: int  # Q4_K's one-row kernel: blocks per step (two rows a program, a 16-byte chunk per thread)
    gemm_m: int
    gemm_n: int
    gemm_k: int
    small_n: int = 32  # the GEMM's tiles for 2-8 rows of the float-sum types (16 rows of x a tile)
    small_k: int = 128

    @classmethod
    def for_shape(cls, n: int, k: int) -> Tiles:
        # the one-row kernel: within 10% of the fastest of a sweep on an H200 (rows 1-16 per program, k
        # steps 128-1024, 2-8 warps) for Q8_0, Q4_K and Q6_K at 4096x2048, 2048x4096 and 151936x2048
        # Q4_K's one row: the fastest of a sweep on an H200 (rows 1-4 a program, 1-8 blocks a step, 1-4 warps)
        # at 4096x2048, 2048x4096, 6144x2048, 512x2048 and 2048x768: wide steps only for few rows.
        blocks = 2 if n >= 2048 else min(8, triton.next_power_of_2(max(1, k // 256)))
        # 2-8 rows: the fastest of 16 x 32-128 x 64-256 tiles on an H200 (Q8_0 5120x2048 and 2048x4096)
        return cls(min(1024, triton.next_power_of_2(k)), blocks, 64, 64, 64, 32, min(128, triton.next_power_of_2(k)))


def row_bytes(qtype: Q, k: int) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    return k // block * size


def int16_tiles(qtype: Q, n: int, k: int, tiles: Tiles) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """The int16 kernel's (weight rows a program, blocks a step, warps) for one row and for 2-8 rows of an n x k
    matrix of `qtype` (Q4_K or Q6_K)."""
    # a 16-byte chunk a thread: 8 chunks a Q4_K block, 4 a Q6_K one; two weight rows a program
    chunks = 8 if qtype == Q.Q4_K else 4
    blocks = min(tiles.row_blocks * 8 // chunks, triton.next_power_of_2(max(1, k // 256)))
    warps = max(1, 2 * blocks * chunks // 32)
    # one row: the same, but the Q6_K head (151,936 rows) four rows a program, a block a step, one warp:
    # 186.8 -> 150.5 us on an H200, the fastest of `python -m engine.kernels.sweep` (rows 1-4, blocks 1-8,
    # warps 1-4)
    head = qtype == Q.Q6_K and n >= 32768
    one_row = (4, 1, 1) if head else (2, blocks, warps)
    # 2-8 rows: the Q6_K head eight rows a program (565.2 -> 396.5 us at 8 rows), a Q4_K matrix of k >= 4096
    # four rows and two warps (2048x4096: 24.9 -> 17.5 us), the fastest of a sweep on an H200 (rows 1-8,
    # blocks 2-8, warps 1-2); where `mma_tiles` names tiles (the head, Q4_K below head size) the tensor cores
    # take 2-8 rows instead
    rows = (8, 4, 1) if head else (4, 8, 2) if qtype == Q.Q4_K and k >= 4096 else (2, blocks, warps)
    return one_row, rows


@dataclass(frozen=True)
class MmaTiles:
    """The tensor-core kernels' launch for 2-8 rows of a matrix: weight rows a program, warps, stages, and the
    parts k is cut into (each a program of its own; `_add_parts` adds them in order, so the sums' order is
    fixed by the matrix's shape, never by m)."""

    rows: int
    warps: int
    stages: int
    parts: int = 1


def mma_tiles(qtype: Q, n: int, k: int) -> MmaTiles | None:
    """The tensor cores' tiles for 2-8 rows of an n x k matrix of `qtype`, or None where the int16 kernel (Q8_0:
    the GEMM) is faster. 8 rows, H100, one call replayed from a CUDA graph (`sweep.dense_mma`):
    - the Q6_K head: 404.0 -> 278.9 us; the Q8_0 head stays on its GEMM (220.2 against 264.9 at best);
    - Q4_K and Q8_0 matrices below head size, k cut into parts of 512 values so that enough programs fill the GPU
      (one part was 1.5-4x slower): Q4_K 5120 x 2048 20.4 -> 17.6 us, 2048 x 4096 18.0 -> 15.5; Q8_0 5120 x 2048
      17.9 -> 15.1, 2048 x 4096 27.7 -> 14.4, 512 x 2048 15.3 -> 10.4 (two warps a Q8_0 program, one a Q4_K's);
    - Q6_K's small matrices keep the int16 kernel (512 x 2048: 8.3 against 10.0 us at best)."""
    if n >= 32768:
        return MmaTiles(32, 2, 2) if qtype == Q.Q6_K else None
    part = 2 * MMA_STEP  # the values of k a program takes, at least
    if qtype not in (Q.Q4_K, Q.Q8_0) or k < 2 * part:
        return None
    parts = 8
    while parts > k // part or (k // MMA_STEP) % parts:
        parts //= 2
    return MmaTiles(32, 2 if qtype == Q.Q8_0 else 1, 2, parts)


class Matrix:
    """n weight rows of `qtype` blocks (uint8 [n, row_bytes(qtype, k)] on the kernels' device), checked
    once, with its tiles chosen once, for products called many times."""

    def __init__(self, qtype: Q, blocks: torch.Tensor, k: int, tiles: Tiles | None = None):
        if qtype not in SUPPORTED:
            names = ", ".join(t.name for t in SUPPORTED)
            raise ValueError(f"{Q(qtype).name} has no Triton kernel (supported: {names})")
        block = GGML_QUANT_SIZES[qtype][0]
        if k % block:
            raise ValueError(f"k={k} is not a multiple of the {qtype.name} block size {block}")
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != row_bytes(qtype, k):
            raise ValueError(f"blocks must be uint8 [n, {row_bytes(qtype, k)}] for {qtype.name} with k={k}, "
                             f"got {blocks.dtype} {tuple(blocks.shape)}")
        if not blocks.is_contiguous():
            raise ValueError("blocks must be contiguous")
        self.qtype, self.blocks, self.k, self.n = qtype, blocks, k, blocks.shape[0]
        self.tiles = tiles or Tiles.for_shape(self.n, k)
        # Q4_K and Q6_K decode products sum x rounded to int16 (`triton_xq`), a 16-byte chunk a thread: 8
        # chunks a Q4_K block, 4 a Q6_K one; two weight rows a program
        aligned = blocks.data_ptr() % 4 == 0
        self._rounded = qtype in ROUNDED and aligned
        self._one_row, self._rows = int16_tiles(qtype, self.n, k, self.tiles)
        self._mma = mma_tiles(qtype, self.n, k) if aligned and takes_tensor_cores(qtype, k) else None
        if self._rounded or self._mma:
            RoundedRows.want(blocks.device, planes=self._mma is not None)
        # the float-sum types' one row (values a step, warps) and their 2-8 rows' GEMM (warps, stages); the Q8_0
        # head (151,936 x 2,048) the fastest of a sweep on an H200 (rows 1-8 a program, steps 512-2048, warps
        # 1-4; warps 1-8 and stages 2-4): one row 148.0 -> 132.4 us, 8 rows 247.5 -> 223.8 us
        q8_head = qtype == Q.Q8_0 and self.n >= 32768
        self._float_row = (512, 1) if q8_head else (self.tiles.row_k, 2)
        self._small_gemm = (2, 2) if q8_head else (4, 3)
        self._type_args = dict(QTYPE=int(qtype), GROUP=GROUP[qtype])

    def _checked(self, x: torch.Tensor) -> torch.Tensor:
        """x itself, or a copy where its rows do not start 16-byte aligned: Triton compiles a kernel per
        alignment of its pointers (loads laid out differently), and every call of a matrix must run one
        kernel for its rows not to depend on the call."""
        if (x.dtype not in X_DTYPES or x.dim() != 2 or x.shape[1] != self.k or x.device != self.blocks.device
                or not x.is_contiguous()):
            raise ValueError(f"x must be a contiguous float32/bf16/f16 tensor [m, {self.k}] on "
                             f"{self.blocks.device}, got {x.dtype} {tuple(x.shape)} on {x.device}")
        return x.clone() if x.data_ptr() % 16 else x

    def _out(self, x: torch.Tensor) -> torch.Tensor:
        return torch.empty(x.shape[0], self.n, dtype=x.dtype, device=x.device)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [m, k] @ W.T -> [m, n] in x's dtype: the matvec up to `MATVEC_ROWS` rows, the GEMM above."""
        return self.matvec(x) if x.shape[0] <= MATVEC_ROWS else self.gemm(x)

    def matvec(self, x: torch.Tensor) -> torch.Tensor:
        """x [m <= MATVEC_ROWS, k] @ W.T -> [m, n] in x's dtype, accumulated in float32."""
        x = self._checked(x)
        if x.shape[0] > MATVEC_ROWS:
            raise ValueError(f"the matvec takes at most {MATVEC_ROWS} rows, got {x.shape[0]}")
        y = self._out(x)
        t = self.tiles
        if x.shape[0] > 1 and self._mma is not None:
            self._on_tensor_cores(x, y, self._mma)
        elif x.shape[0] and self._rounded:
            rounded = RoundedRows.of(x)
            rows, blocks, warps = self._one_row if x.shape[0] == 1 else self._rows
            _rounded_kernel[(triton.cdiv(self.n, rows),)](
                self.blocks, rounded.q, rounded.scale, rounded.sums, rounded.halves, y, x.shape[0], self.n, self.k,
                self.blocks.shape[1], QTYPE=int(self.qtype), R=rows, SB=blocks,
                ROWS=1 if x.shape[0] == 1 else MATVEC_ROWS, ASM=ASM, num_warps=warps, **pdl.launch(x.device))
        elif x.shape[0] == 1:
            step, warps = self._float_row
            _row_kernel[(self.n,)](self.blocks, x, y, self.n, self.k, self.blocks.shape[1], **self._type_args, R=1,
                                   BK=step, num_warps=warps, **_FUSED, **pdl.launch(x.device))
        elif x.shape[0]:
            warps, stages = self._small_gemm
            self._gemm(x, y, SMALL_M, t.small_n, t.small_k, num_warps=warps, num_stages=stages)
        return y

    def _on_tensor_cores(self, x: torch.Tensor, y: torch.Tensor, tiles: MmaTiles) -> None:
        parts = tiles.parts
        per = steps_per_part(self.qtype, self.k, parts)
        rounded, m = RoundedRows.of(x), x.shape[0]
        out = y if parts == 1 else torch.empty(parts, MATVEC_ROWS, self.n, dtype=torch.float32, device=x.device)
        _mma_kernel[(triton.cdiv(self.n, tiles.rows), parts)](
            self.blocks, *rounded.planes(), rounded.scale, rounded.sums, out, m, self.n, self.k, self.blocks.shape[1],
            per, QTYPE=int(self.qtype), R=tiles.rows, ASM=ASM, num_warps=tiles.warps,
            num_stages=tiles.stages, **pdl.launch(x.device))
        if parts > 1:
            block = 1024
            _add_parts[(triton.cdiv(m * self.n, block),)](out, y, m, self.n, PARTS=parts, BLOCK=block,
                                                          **pdl.launch(x.device))

    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        """x [m, k] @ W.T -> [m, n] in x's dtype: tiles of W dequantized to x's dtype, float32 sums."""
        x = self._checked(x)
        y = self._out(x)
        if x.shape[0]:
            self._gemm(x, y, self.tiles.gemm_m, self.tiles.gemm_n, self.tiles.gemm_k)
        return y

    def _gemm(self, x: torch.Tensor, y: torch.Tensor, bm: int, bn: int, bk: int, **launch: int) -> None:
        grid = (triton.cdiv(x.shape[0], bm), triton.cdiv(self.n, bn))
        _gemm_kernel[grid](self.blocks, x, y, x.shape[0], self.n, self.k, self.blocks.shape[1], **self._type_args,
                           BM=bm, BN=bn, BK=bk, **_FUSED, **launch, **pdl.launch(x.device))

    def dequantize(self, ids: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `ids` of W (all rows: None) as [len(ids), k] of `dtype`."""
        return dequantize_blocks(self.qtype, self.blocks if ids is None else self.blocks[ids], self.k, dtype)


def dequantize_blocks(qtype: Q, blocks: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Weight rows given as their blocks, uint8 [rows, row_bytes(qtype, k)], as [rows, k] of `dtype`."""
    y = torch.empty(blocks.shape[0], k, dtype=dtype, device=blocks.device)
    if blocks.shape[0]:
        rows, bk = 4, min(1024, triton.next_power_of_2(k))
        grid = (triton.cdiv(blocks.shape[0], rows), triton.cdiv(k, bk))
        # no fused multiply-add: q * scale - min rounds twice, as gguf-py's float32 numpy does
        _dequantize_kernel[grid](blocks, y, blocks.shape[0], k, blocks.shape[1], QTYPE=int(qtype), GROUP=GROUP[qtype],
                                 R=rows, BK=bk, enable_fp_fusion=False, **pdl.launch(y.device))
    return y


_F16_FIELDS = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def random_blocks(qtype: Q, n: int, k: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Random bytes for n rows of k values (tests, the benchmark): every bit pattern of the quants and
    the packed scales, float16 scales of both signs below 2**-7 (zeros and subnormals included); for
    F16/BF16, normal values."""
    if qtype in FLOAT_BLOCKS:  # values, not bit patterns (those would hold NaNs and infinities)
        values = torch.randn(n, k, generator=generator) * 0.05
        return values.to(FLOAT_DTYPE[qtype]).view(torch.uint8)
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = torch.randint(0, 256, (n, k // block, size), dtype=torch.uint8, generator=generator)
    for at in _F16_FIELDS[qtype]:
        blocks[..., at + 1] &= 0x9F  # the top two exponent bits cleared: |d| < 2**-7, as real scales are
    return blocks.reshape(n, -1)


def _bench() -> None:
    """Per type and shape: matvec GB/s (weight bytes over time) at m=1 and m=8, GEMM TFLOP/s at m=512, x bf16,
    beside torch's bf16 product of the same shape (each the mean of triton.testing.do_bench, L2 flushed)."""
    from triton.testing import do_bench

    def seconds(fn, x: torch.Tensor) -> float:
        return do_bench(lambda: fn(x)) * 1e-3

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for n, k in ((2048, 768), (768, 2048), (4096, 2048), (151936, 2048)):
        xs = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in (1, 8, 512)}
        dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        linear = functools.partial(torch.nn.functional.linear, weight=dense)
        runs = [("bf16 torch", dense.numel() * 2, linear, linear)]
        for qtype in SUPPORTED:
            mat = Matrix(qtype, random_blocks(qtype, n, k).cuda(), k)
            runs.append((qtype.name, mat.blocks.numel(), mat.matvec, mat.gemm))
        for name, nbytes, matvec, gemm in runs:
            t1, t8, tg = seconds(matvec, xs[1]), seconds(matvec, xs[8]), seconds(gemm, xs[512])
            print(f"{name:10} {n:>6} x {k:<5} matvec m=1 {nbytes / t1 / 1e9:7.1f} GB/s  "
                  f"m=8 {nbytes / t8 / 1e9:7.1f} GB/s  gemm m=512 {2 * 512 * n * k / tg / 1e12:6.1f} TFLOP/s")


if __name__ == "__main__":
    _bench()
