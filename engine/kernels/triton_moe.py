"""A fused MoE kernel over GGUF blocks: every (row, expert) pair of a window in one launch per projection,
gate and up together (their SwiGLU applied in the same launch), each expert's weights read from its blocks.

The experts of a layer are stacks of the file's blocks, uint8 `[slots, n, row_bytes]` (`Stack`); an expert
id is looked up through a slot table (`slot_of[expert]`, int32 on the device), so a cache of slots can
stand in for the whole expert tensor: `slot >= 0` reads the stack's slot, `SKIP` (-1) leaves the pair's
output row unwritten (another device computes it), `far_slot(i)` (-2 - i) reads entry i of the stack's
`far` tensor (the expert tier's copy of every expert in pinned host memory, read over PCIe). A window's routed pairs are sorted by expert (`Routing`, on
the device, no host sync):

- decode windows (up to `MATVEC_ROWS` rows): one program per (tile of weight rows, sorted pair), the first
  pair of each expert's run computing every pair of the run (at most `MATVEC_ROWS`, one per row), the others
  nothing; or (`Tiles.pairs_a_program` above 1) fewer programs a tile, which walk the window's runs in turn.
  So each routed expert's rows are read once for all its pairs (`Tiles.joint`: Q4_K gates and ups in one pass,
  each x chunk loaded once for both, the same sums). A pair alone on its
  expert (every pair of a one-row window) takes `triton_blocks`' one-row sums (~2x faster). With
  `Tiles.int8_windows` (Q8_0 stacks' own tiles) windows of 2-8 rows sum x rounded to int8 (`triton_xq`).
  F16 and BF16 windows of 2-8 rows put every pair, alone too, on the tensor cores (`_float_mma`, tf32 tiles).
  With `Tiles.tile_runs` (off until timed) Q4_K and Q6_K runs take tiles of x's dtype dequantized in registers
  (`triton_tiles.tile_sums`) instead of the int8 products.
- prompt chunks: each expert's pairs are padded to whole tiles of `Tiles.gemm_m` pairs; one program per
  (pair tile, weight row tile) dequantizes the expert's weight tiles in registers and multiplies them
  with tl.dot (`Tiles.joint`: Q4_K gates and ups in one pass, each x tile loaded once for both).

Float32 accumulation, no atomics (runs may cut k into parts, `Tiles.run_parts`, added in order by a second
launch); tile sizes come from the matrices' types and shapes only (`Tiles`), so
a pair's result depends on its own row, and in the matvec on whether its expert's run has company: in a run
of 2-8 a pair runs the same instructions whatever its place, alone it runs the one-row sums (exact mode runs
rows alone: always those); in the GEMM it is the same dots over the same tiles whatever its place in the
tile (as in `triton_blocks`). The paths round differently from each other.

`python -m engine.kernels.triton_moe` prints the fused kernel's time, GB/s and TFLOP/s for decode windows
and a prompt chunk beside torch's bf16 grouped GEMMs (CUDA, qwen3-30b-a3b's expert shapes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as Q

from engine.kernels import pdl
from engine.kernels.gpu import FLOAT_BLOCKS, SUPPORTED
from engine.kernels.triton_blocks import (
    _BF16,
    _F16,
    _FUSED,
    _Q4_K,
    _Q6_K,
    _Q8_0,
    GROUP,
    MATVEC_ROWS,
    ROUNDED,
    X_DTYPES,
    _group,
    _halves_of,
    _mma_sums,
    _partial,
    _q4k_mma,
    _row_dot,
    _row_dot2_q4k,
    _row_dot_q4k,
    _row_dot_q6k,
    _row_dot_q8_0,
    _rows_dot2_q4k,
    _rows_dot_q4k,
    _rows_dot_q6k,
    _rows_dot_q8_0,
    dequantize_blocks,
    row_bytes,
    steps_per_part,
    takes_tensor_cores,
)
from engine.kernels.triton_tiles import HALF_DTYPES, tile_sums
from engine.kernels.triton_tiles import TYPES as TILE_TYPES
from engine.kernels.triton_xq import ASM, RoundedRows

HAS_MIN = (Q.Q4_K, Q.Q5_K)
INT8_TYPES = {Q.Q4_K, Q.Q6_K, Q.Q8_0}  # the types whose windows of 2-8 rows can take x rounded to int8


@triton.jit
def _matvec_run(w, x, src, p, count, rows, n, k, row_bytes, QTYPE: tl.constexpr, GROUP: tl.constexpr,
                HAS_MIN: tl.constexpr, R: tl.constexpr, BK: tl.constexpr, ROWS: tl.constexpr):
    """[ROWS, R] float32: weight rows `rows` of the expert at `w` times the x rows of pairs p..p+count-1."""
    row = rows.to(tl.int64)[:, None, None] * row_bytes
    g_step = tl.arange(0, BK // GROUP)[None, :, None]
    i = tl.arange(0, GROUP)[None, None, :]
    r = tl.arange(0, ROWS)[:, None]
    groups = k // GROUP
    acc = tl.zeros((ROWS, R), dtype=tl.float32)
    for e0 in range(0, k, BK):
        g = e0 // GROUP + g_step
        q, scale, minimum = _group(w, row, g, i, (rows[:, None, None] < n) & (g < groups), QTYPE)
        for j in tl.static_range(ROWS):
            if j < count:
                xrow = tl.load(src + p + j).to(tl.int64)
                xj = tl.load(x + xrow * k + g * GROUP + i, mask=g < groups, other=0.0).to(tl.float32)
                part = _partial(q, scale, minimum, xj, HAS_MIN)
                acc = tl.where(r == j, acc + part[None, :], acc)
    return acc


@triton.jit
def _one_row(w, rows, n, x, xq, xs, xsum, xh, at, k, row_bytes, QTYPE: tl.constexpr, GROUP: tl.constexpr,
             R: tl.constexpr, BK: tl.constexpr, SB: tl.constexpr, ASM: tl.constexpr):
    """[R] float32: weight rows `rows` of the expert at `w` times x row `at` (Q4_K, Q6_K: its int16 rounding; int8
    where xq is int8, Q8_0 too)."""
    if QTYPE == _Q4_K:
        out = _row_dot_q4k(w, rows, n, xq + at * k, xs + at * (k // 32), xsum + at * (k // 32), k, row_bytes, R, SB,
                           ASM)
    elif QTYPE == _Q6_K:
        out = _row_dot_q6k(w, rows, n, xq + at * k, xs + at * (k // 32), xh + at * (k // 16), k, row_bytes, R, SB, ASM)
    elif (QTYPE == _Q8_0) & (xq.dtype.element_ty == tl.int8):
        out = _row_dot_q8_0(w, rows, n, xq + at * k, xs + at * (k // 32), k, row_bytes, R, BK // 32, ASM)
    else:
        out = _row_dot(w, rows, n, x + at * k, k, row_bytes, QTYPE, GROUP, R, BK)
    return out


@triton.jit
def _run_rows(w, rows, n, x, xq, xs, xsum, xh, src, p, count, k, b0, b1, row_bytes, QTYPE: tl.constexpr,
              GROUP: tl.constexpr, HAS_MIN: tl.constexpr, R: tl.constexpr, BK: tl.constexpr, ROWS: tl.constexpr,
              SB: tl.constexpr, ASM: tl.constexpr):
    """[ROWS, R] float32: weight rows `rows` of the expert at `w` times the x rows of pairs p..p+count-1 (Q4_K,
    Q6_K: over blocks [b0, b1) of k; the int8 sums of Q8_0 and the float sums of other types: all of k)."""
    if QTYPE == _Q4_K:
        out = _rows_dot_q4k(w, rows, n, xq, xs, xsum, src + p, count, k, b0, b1, row_bytes, R, SB, ROWS, ASM, True)
    elif QTYPE == _Q6_K:
        out = _rows_dot_q6k(w, rows, n, xq, xs, xh, src + p, count, k, b0, b1, row_bytes, R, SB, ROWS, ASM, True)
    elif (QTYPE == _Q8_0) & (xq.dtype.element_ty == tl.int8):
        out = _rows_dot_q8_0(w, rows, n, xq, xs, src + p, count, k, row_bytes, R, BK // 32, ROWS, ASM)
    else:
        out = _matvec_run(w, x, src, p, count, rows, n, k, row_bytes, QTYPE, GROUP, HAS_MIN, R, BK, ROWS)
    return out


@triton.jit
def _mma_rows(w, rows, n, xq, xs, xsum, x_row, x_live, k, b0, b1, row_bytes, QTYPE: tl.constexpr, R: tl.constexpr,
              ASM: tl.constexpr):
    """[8, R] float32: weight rows `rows` of the expert at `w` (a `TENSOR_CORES` type) times the x rows `x_row`
    [16] (rows t and t + 8 alike, `x_live`) over k's 256-value steps [b0, b1) on the tensor cores, x's int8 planes
    split from its int16 values."""
    return _halves_of(_mma_sums(w, rows.to(tl.int64) * row_bytes, rows < n, xq, xq, xs, xsum, x_row, x_live, k, b0,
                                b1, QTYPE, R, False, ASM), R)


@triton.jit
def _float_mma(w, w2, rows, n, x, src, p, count, k, row_bytes, QTYPE: tl.constexpr, R: tl.constexpr,
               BK: tl.constexpr, BOTH: tl.constexpr):
    """[16, R] float32 (and w2's, BOTH: a matrix of w's shape, from the same x tiles): the x rows of pairs
    p..p+count-1 (tile rows 0..count-1, zeros below) times weight rows `rows` of the F16 or BF16 expert at `w`, on
    the tensor cores as tf32 products: a bf16 or f16 x and the weights are exact in tf32, so the products are the
    float sums' own, summed in float32. Each x row is a row of the tile of its own: its bits do not depend on the
    others."""
    if QTYPE == _F16:
        wv, wv2 = w.to(tl.pointer_type(tl.float16)), w2.to(tl.pointer_type(tl.float16))
    else:
        wv, wv2 = w.to(tl.pointer_type(tl.bfloat16)), w2.to(tl.pointer_type(tl.bfloat16))
    t = tl.arange(0, 16)
    c = tl.arange(0, BK)
    x_live = (t < count)[:, None]
    x_at = x + tl.load(src + p + t, mask=t < count, other=0).to(tl.int64)[:, None] * k + c[None, :]
    w_at = rows.to(tl.int64)[:, None] * (row_bytes // 2) + c[None, :]
    live_w = (rows < n)[:, None]
    acc = tl.zeros((16, R), dtype=tl.float32)
    acc2 = tl.zeros((16, R), dtype=tl.float32)
    for e0 in range(0, k, BK):
        in_k = e0 + c[None, :] < k
        xt = tl.load(x_at + e0, mask=x_live & in_k, other=0.0).to(tl.float32)
        wt = tl.load(wv + w_at + e0, mask=live_w & in_k, other=0.0).to(tl.float32)
        acc = tl.dot(xt, tl.trans(wt), acc, input_precision="tf32")
        if BOTH:
            wt2 = tl.load(wv2 + w_at + e0, mask=live_w & in_k, other=0.0).to(tl.float32)
            acc2 = tl.dot(xt, tl.trans(wt2), acc2, input_precision="tf32")
    return acc, acc2


@triton.jit
def _expert_at(w, far, slot, expert_bytes):
    """The expert's blocks: slot `slot` of the stack, or entry -2 - slot of `far` (slot <= -2)."""
    base = w + slot * expert_bytes
    if slot < -1:
        base = far + (-2 - slot) * expert_bytes
    return base


@triton.jit
def _run_start(experts, slot_of, p):
    """Sorted pair p's expert, its slot table entry (for the first pair; SKIP for the others, which leave at once
    without waiting for that load), and whether p is the first pair of its expert's run."""
    e = tl.load(experts + p)
    before = tl.load(experts + p - 1, mask=p > 0, other=-1)
    first = e != before
    return e, tl.load(slot_of + e, mask=first, other=-1), first


@triton.jit(do_not_specialize=["pairs"])  # one compiled kernel for every window
def _moe_matvec_kernel(w, w2, wf, wf2, slot_of, experts, src, dst, x, xq, xs, xsum, xh, y, parts, pairs, n, k,
                       row_bytes, expert_bytes, row_bytes2, expert_bytes2, QTYPE: tl.constexpr, GROUP: tl.constexpr,
                       HAS_MIN: tl.constexpr, QTYPE2: tl.constexpr, GROUP2: tl.constexpr, HAS_MIN2: tl.constexpr,
                       GATED: tl.constexpr, JOINT: tl.constexpr, R: tl.constexpr, BK: tl.constexpr,
                       ROWS: tl.constexpr, SB: tl.constexpr, SB2: tl.constexpr, ASM: tl.constexpr, MMA: tl.constexpr,
                       ALONE: tl.constexpr, PARTS: tl.constexpr, WALKS: tl.constexpr, PAIRS: tl.constexpr,
                       PDL: tl.constexpr, TILE_RUNS: tl.constexpr):
    """Program (weight-row tile, g, part): g is a sorted pair, which computes its expert's run where it is the first
    of it (a run: an expert's sorted pairs, 1 to ROWS of them; the others do nothing); WALKS: the window's runs g,
    g + G, g + 2G, ... in turn (G programs a tile, the grid's second size), found in the sorted experts (a
    block of PAIRS >= pairs). PARTS > 1 (runs on the tensor cores, or of Q4_K and Q6_K on the int16 sums): part s
    of a run's sums, k's 256-value steps [s * k / PARTS, (s + 1) * k / PARTS), into `parts` float32 [PARTS, 1 +
    GATED, pairs, n] (the gates' then the ups'), for `_add_run_parts`; pairs alone take part 0. ALONE: pairs alone
    take the one-row sums (else they are runs of one, as the F16 and BF16 windows on the tensor cores take them).
    TILE_RUNS: runs on the tensor cores take bf16/f16 tiles dequantized in registers (`Tiles.tile_runs`)."""
    pdl.wait(PDL)
    rows = tl.program_id(0) * R + tl.arange(0, R)
    part = tl.program_id(2)
    if not WALKS:
        p = tl.program_id(1)
        e, slot, first = _run_start(experts, slot_of, p)
        if first & (slot != -1):  # the first pair of its expert's run; the run's other pairs follow it
            ahead = p + tl.arange(0, ROWS)
            count = tl.sum((tl.load(experts + ahead, mask=ahead < pairs, other=-1) == e).to(tl.int32))
            _expert_run(w, w2, wf, wf2, src, dst, x, xq, xs, xsum, xh, y, parts, pairs, n, k, row_bytes, expert_bytes,
                        row_bytes2, expert_bytes2, rows, p, count, slot.to(tl.int64), part, QTYPE, GROUP, HAS_MIN,
                        QTYPE2, GROUP2, HAS_MIN2, GATED, JOINT, R, BK, ROWS, SB, SB2, ASM, MMA, ALONE, PARTS,
                        TILE_RUNS)
    else:
        at = tl.arange(0, PAIRS)
        live = at < pairs
        expert = tl.load(experts + at, mask=live, other=-1)
        starts = live & (expert != tl.load(experts + at - 1, mask=live & (at > 0), other=-1))
        run_of = tl.cumsum(starts.to(tl.int32), 0)  # each sorted pair's run, from 1
        for r in range(tl.program_id(1) + 1, tl.sum(starts.to(tl.int32)) + 1, tl.num_programs(1)):
            in_run = live & (run_of == r)
            p = tl.min(tl.where(in_run, at, PAIRS), 0)  # the run's first sorted pair
            slot = tl.load(slot_of + tl.load(experts + p)).to(tl.int64)
            if slot != -1:
                _expert_run(w, w2, wf, wf2, src, dst, x, xq, xs, xsum, xh, y, parts, pairs, n, k, row_bytes,
                            expert_bytes, row_bytes2, expert_bytes2, rows, p, tl.sum(in_run.to(tl.int32)), slot, part,
                            QTYPE, GROUP, HAS_MIN, QTYPE2, GROUP2, HAS_MIN2, GATED, JOINT, R, BK, ROWS, SB, SB2, ASM,
                            MMA, ALONE, PARTS, TILE_RUNS)


@triton.jit
def _expert_run(w, w2, wf, wf2, src, dst, x, xq, xs, xsum, xh, y, parts, pairs, n, k, row_bytes, expert_bytes,
                row_bytes2, expert_bytes2, rows, p, count, slot, part, QTYPE: tl.constexpr, GROUP: tl.constexpr,
                HAS_MIN: tl.constexpr, QTYPE2: tl.constexpr, GROUP2: tl.constexpr, HAS_MIN2: tl.constexpr,
                GATED: tl.constexpr, JOINT: tl.constexpr, R: tl.constexpr, BK: tl.constexpr, ROWS: tl.constexpr,
                SB: tl.constexpr, SB2: tl.constexpr, ASM: tl.constexpr, MMA: tl.constexpr, ALONE: tl.constexpr,
                PARTS: tl.constexpr, TILE_RUNS: tl.constexpr):
    """A `_moe_matvec_kernel` program's work on the run of `count` sorted pairs from p, on the expert at `slot`:
    the one-row sums for a pair alone (ALONE), else the run's."""
    if (count == 1) & ALONE:  # alone on its expert, as every pair of a one-row window: the one-row sums
        if part == 0:
            at = tl.load(src + p).to(tl.int64)
            if JOINT:  # Q4_K gates and ups in one pass, both matrices' loads in flight together
                one, up1 = _row_dot2_q4k(_expert_at(w, wf, slot, expert_bytes),
                                         _expert_at(w2, wf2, slot, expert_bytes2), rows, n, xq + at * k,
                                         xs + at * (k // 32), xsum + at * (k // 32), k, row_bytes, R, SB, ASM)
                one = one * tl.sigmoid(one) * up1
            else:
                one = _one_row(_expert_at(w, wf, slot, expert_bytes), rows, n, x, xq, xs, xsum, xh, at, k,
                               row_bytes, QTYPE, GROUP, R, BK, SB, ASM)
                if GATED:
                    up1 = _one_row(_expert_at(w2, wf2, slot, expert_bytes2), rows, n, x, xq, xs, xsum, xh, at, k,
                                   row_bytes2, QTYPE2, GROUP2, R, BK, SB2, ASM)
                    one = one * tl.sigmoid(one) * up1
            tl.store(y + tl.load(dst + p).to(tl.int64) * n + rows, one.to(y.dtype.element_ty), mask=rows < n)
    else:  # a run of 2-8 pairs: part `part` of k's 256-value steps
        b0 = 0  # one part: a loop from 0, as the compiler laid it out before parts (80 registers, not 64)
        b1 = k // 256
        if PARTS > 1:
            b0 = part * (k // 256 // PARTS)
            b1 = b0 + k // 256 // PARTS
        if MMA > 0 and (QTYPE == _F16 or QTYPE == _BF16):  # tf32 tiles of 16 x rows (gates and ups together)
            tile = tl.program_id(0) * R + tl.arange(0, R)
            acc, up = _float_mma(_expert_at(w, wf, slot, expert_bytes), _expert_at(w2, wf2, slot, expert_bytes2),
                                 tile, n, x, src, p, count, k, row_bytes, QTYPE, R, BK, GATED)
            _store_run(acc, up, y, parts, dst, p, count, tile, n, pairs, part, 16, GATED, PARTS)
        elif (MMA > 0) & TILE_RUNS:  # tiles of x's dtype dequantized in registers, each x row a tile row of its own
            if (tl.program_id(0) * R) % MMA == 0:
                tile = tl.program_id(0) * R + tl.arange(0, MMA)
                t = tl.arange(0, 16)
                x_at = x + tl.load(src + p + t, mask=t < count, other=0).to(tl.int64)[:, None] * k
                acc = tl.zeros((16, MMA), dtype=tl.float32)
                acc, up = tile_sums(_expert_at(w, wf, slot, expert_bytes), _expert_at(w2, wf2, slot, expert_bytes2),
                                    tile.to(tl.int64) * row_bytes, tile < n, x_at, (t < count)[:, None], b0, b1, acc,
                                    acc, QTYPE, MMA, GATED)
                _store_run(acc, up, y, parts, dst, p, count, tile, n, pairs, part, 16, GATED, PARTS)
        elif MMA > 0:  # on the tensor cores: the programs whose weight rows start a tile of MMA rows
            if (tl.program_id(0) * R) % MMA == 0:
                tile = tl.program_id(0) * R + tl.arange(0, MMA)
                t = tl.arange(0, 16) % 8  # tile rows t and t + 8: the run's pair t
                x_live = t < count
                x_row = tl.load(src + p + t, mask=x_live, other=0).to(tl.int64)
                wa = _expert_at(w, wf, slot, expert_bytes)
                if JOINT:  # Q4_K gates and ups in one pass, each x tile split once for both
                    acc, up = _q4k_mma(wa, _expert_at(w2, wf2, slot, expert_bytes2), tile.to(tl.int64) * row_bytes,
                                       tile < n, xq, xq, xs, xsum, x_row, x_live, k, b0, b1, MMA, True, False, ASM)
                    acc, up = _halves_of(acc, MMA), _halves_of(up, MMA)
                else:
                    acc = _mma_rows(wa, tile, n, xq, xs, xsum, x_row, x_live, k, b0, b1, row_bytes, QTYPE, MMA, ASM)
                    up = acc
                    if GATED:
                        up = _mma_rows(_expert_at(w2, wf2, slot, expert_bytes2), tile, n, xq, xs, xsum, x_row,
                                       x_live, k, b0, b1, row_bytes2, QTYPE2, MMA, ASM)
                _store_run(acc, up, y, parts, dst, p, count, tile, n, pairs, part, 8, GATED, PARTS)
        else:
            if JOINT:  # Q4_K gates and ups in one pass, each x chunk loaded once for both
                acc, up = _rows_dot2_q4k(_expert_at(w, wf, slot, expert_bytes),
                                         _expert_at(w2, wf2, slot, expert_bytes2), rows, n, xq, xs, xsum, src + p,
                                         count, k, b0, b1, row_bytes, R, SB, ROWS, ASM)
            else:
                acc = _run_rows(_expert_at(w, wf, slot, expert_bytes), rows, n, x, xq, xs, xsum, xh, src, p, count,
                                k, b0, b1, row_bytes, QTYPE, GROUP, HAS_MIN, R, BK, ROWS, SB, ASM)
                up = acc
                if GATED:  # w holds the gates, w2 the ups: y = silu(gate) * up
                    up = _run_rows(_expert_at(w2, wf2, slot, expert_bytes2), rows, n, x, xq, xs, xsum, xh, src, p,
                                   count, k, b0, b1, row_bytes2, QTYPE2, GROUP2, HAS_MIN2, R, BK, ROWS, SB2, ASM)
            _store_run(acc, up, y, parts, dst, p, count, rows, n, pairs, part, ROWS, GATED, PARTS)


@triton.jit
def _store_run(acc, up, y, parts, dst, p, count, cols, n, pairs, part, ROWS: tl.constexpr, GATED: tl.constexpr,
               PARTS: tl.constexpr):
    """A run's sums [ROWS, C] for its pairs p..p+count-1 and weight rows `cols`: into y (silu(gate) * up when
    GATED), or in parts (PARTS > 1) part `part`'s into `parts` [PARTS, 1 + GATED, pairs, n], gates then ups."""
    r = tl.arange(0, ROWS)[:, None]
    live = (r < count) & (cols[None, :] < n)
    if PARTS == 1:
        if GATED:
            acc = acc * tl.sigmoid(acc) * up
        out = y + tl.load(dst + p + r, mask=r < count, other=0).to(tl.int64) * n + cols[None, :]
        tl.store(out, acc.to(y.dtype.element_ty), mask=live)
    else:  # the run's sorted pairs' rows of this part (`_add_run_parts` adds the parts)
        at = parts + ((part * (2 if GATED else 1)) * pairs + p + r).to(tl.int64) * n + cols[None, :]
        tl.store(at, acc, mask=live)
        if GATED:
            tl.store(at + pairs * n, up, mask=live)


@triton.jit(do_not_specialize=["pairs"])
def _add_run_parts(parts, y, experts, slot_of, dst, pairs, n, GATED: tl.constexpr, PARTS: tl.constexpr,
                   BLOCK: tl.constexpr, PDL: tl.constexpr):
    """y's row of sorted pair p = program_id(0), where p is in a run of 2-8 on a computed expert: its parts
    (`_moe_matvec_kernel`'s PARTS > 1) added in order, silu(gate) * up when GATED."""
    pdl.wait(PDL)
    p = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(experts + p)
    in_run = (tl.load(experts + p - 1, mask=p > 0, other=-1) == e) | \
        (tl.load(experts + p + 1, mask=p + 1 < pairs, other=-1) == e)
    if in_run & (tl.load(slot_of + e) != -1):
        at = parts + p.to(tl.int64) * n + cols
        live = cols < n
        acc = tl.load(at, mask=live, other=0.0)
        for s in tl.static_range(1, PARTS):
            acc += tl.load(at + s * (2 if GATED else 1) * pairs * n, mask=live, other=0.0)
        if GATED:
            up = tl.load(at + pairs * n, mask=live, other=0.0)
            for s in tl.static_range(1, PARTS):
                up += tl.load(at + (2 * s + 1) * pairs * n, mask=live, other=0.0)
            acc = acc * tl.sigmoid(acc) * up
        tl.store(y + tl.load(dst + p).to(tl.int64) * n + cols, acc.to(y.dtype.element_ty), mask=live)


@triton.jit
def _gemm_tiles(w, w2, xs_at, live, rows, n, k, row_bytes, acc, acc2, x_dtype: tl.constexpr, QTYPE: tl.constexpr,
                GROUP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BOTH: tl.constexpr):
    """acc [BM, BN] += the x rows at `xs_at` [BM, 1] (pointers, `live` [BM, 1]) times weight rows `rows` of w;
    BOTH: acc2 += the same x times those of w2 (of w's type and shape: a layer's gates and ups), in the same pass
    over k, each step's x tile loaded once for both, each product's dots those of a pass of its own."""
    row = rows.to(tl.int64)[:, None, None] * row_bytes
    g_step = tl.arange(0, BK // GROUP)[None, :, None]
    i = tl.arange(0, GROUP)[None, None, :]
    e_step = tl.arange(0, BK)[None, :]
    groups = k // GROUP
    for e0 in range(0, k, BK):
        g = e0 // GROUP + g_step
        live_w = (rows[:, None, None] < n) & (g < groups)
        q, scale, minimum = _group(w, row, g, i, live_w, QTYPE)
        tile = tl.reshape(q * scale - minimum, (BN, BK)).to(x_dtype)
        if BOTH:
            q, scale, minimum = _group(w2, row, g, i, live_w, QTYPE)
            tile2 = tl.reshape(q * scale - minimum, (BN, BK)).to(x_dtype)
        e = e0 + e_step
        xs = tl.load(xs_at + e, mask=live & (e < k), other=0.0)
        acc = tl.dot(xs, tl.trans(tile), acc)
        if BOTH:
            acc2 = tl.dot(xs, tl.trans(tile2), acc2)
    return acc, acc2


@triton.jit
def _moe_gemm_kernel(w, w2, wf, wf2, slot_of, tile_expert, padded, src, dst, x, y, n, k, row_bytes, expert_bytes,
                     row_bytes2, expert_bytes2, QTYPE: tl.constexpr, GROUP: tl.constexpr, QTYPE2: tl.constexpr,
                     GROUP2: tl.constexpr, GATED: tl.constexpr, JOINT: tl.constexpr, BM: tl.constexpr,
                     BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)
    t = tl.program_id(0)
    e = tl.load(tile_expert + t)
    slot = tl.load(slot_of + e, mask=e >= 0, other=-1).to(tl.int64)
    if slot != -1:  # tiles past the window's last one have no expert
        ps = tl.load(padded + t * BM + tl.arange(0, BM))  # sorted pair positions, -1 where padded
        live = (ps >= 0)[:, None]
        xrow = tl.load(src + ps, mask=ps >= 0, other=0).to(tl.int64)
        xs_at = x + xrow[:, None] * k
        rows = tl.program_id(1) * BN + tl.arange(0, BN)
        wa = _expert_at(w, wf, slot, expert_bytes)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if JOINT:  # Q4_K gates and ups in one pass, both tiles of a step from one load of x
            acc, up = _gemm_tiles(wa, _expert_at(w2, wf2, slot, expert_bytes2), xs_at, live, rows, n, k, row_bytes, acc,
                                  tl.zeros((BM, BN), dtype=tl.float32), x.dtype.element_ty, QTYPE, GROUP, BN, BK, True)
        else:
            acc, _ = _gemm_tiles(wa, wa, xs_at, live, rows, n, k, row_bytes, acc, acc, x.dtype.element_ty, QTYPE, GROUP,
                                 BN, BK, False)
            if GATED:  # the ups' pass after the gates'
                wb = _expert_at(w2, wf2, slot, expert_bytes2)
                up = tl.zeros((BM, BN), dtype=tl.float32)
                up, _ = _gemm_tiles(wb, wb, xs_at, live, rows, n, k, row_bytes2, up, up, x.dtype.element_ty, QTYPE2,
                                    GROUP2, BN, BK, False)
        if GATED:  # w holds the gates, w2 the ups: y = silu(gate) * up
            acc = acc * tl.sigmoid(acc) * up
        out = y + tl.load(dst + ps, mask=ps >= 0, other=0).to(tl.int64)[:, None] * n + rows[None, :]
        tl.store(out, acc.to(y.dtype.element_ty), mask=live & (rows[None, :] < n))


@dataclass(frozen=True)
class Tiles:
    """The fused kernel's tile sizes (powers of two) and warps, from the projection's type and shape only,
    never from the window: they fix every pair's reduction order."""

    matvec_rows: int  # weight rows per matvec program
    matvec_k: int  # values of each weight row per matvec step
    gemm_m: int  # pairs per GEMM tile (each expert's pairs are padded to whole tiles)
    gemm_n: int
    gemm_k: int
    matvec_warps: int = 4  # they set how tl.sum reduces: fixed per shape too (F16/BF16 with `mma_rows`: the tiles')
    gemm_warps: int = 4
    row_blocks: int = 1  # Q4_K blocks per step of a pair alone on its expert: a 16-byte chunk per thread
    # Q4_K gates and ups in one pass over the blocks: a run of 2-8 pairs (H200, 8 rows on the same 8 experts:
    # 57.9 -> 44.0 us a layer; on ~50 experts, skewed: 77.0 -> 76.7), a pair alone (one row: 14.1 -> 10.6 us;
    # 8 rows on 44 experts: 71.1 -> 66.1), and the GEMM's tiles of a prompt chunk (512 rows on ~128 experts:
    # 685.9 -> 630.4 us; Q8_0's went 645.5 -> 722.7 that way, so other types keep two passes)
    joint: bool = True
    # weight rows of a program for a run of 2-8 pairs of Q4_K, Q6_K or Q8_0 on the tensor cores (int8 products, x
    # split into two int8 planes; the rows a program otherwise, `matvec_rows`, where fewer); 0: the int16 or float
    # sums, which `for_stack` keeps for those types: on an H100 at 8 rows the runs on the tensor cores were slower
    # at every tile but one (Q4_K gate+up 36.5 -> 64.9 us at best on 8 experts, 46.7 -> 157.6 on 44; Q8_0's down
    # on 8 experts alone gained, 40.9 -> 36.0, and lost on 50, 78.3 -> 99.6): a program takes all of k for its run,
    # too few programs. The F16 windows' tf32 tiles over these types' weights dequantized in registers were slower
    # still (Q4_K gate+up 36.5 -> 74.9 us at best on 8 experts, 46.0 -> 214.6 on 44)
    mma_rows: int = 0
    # F16 and BF16 stacks: where `mma_rows` is set, every pair of a window of 2-8 rows (alone on its expert too) takes
    # tf32 tiles on the tensor cores, programs of `mma_rows` weight rows and `matvec_warps` warps, `mma_k` values of
    # k a step; the float sums' one weight row a program read x's 8 rows for every weight row
    mma_k: int = 128
    # parts of k for the runs of 2-8 pairs (on the tensor cores, or Q4_K and Q6_K runs on the int16 sums), each a
    # program of its own (k // 256 steps split evenly, in whole steps of `row_blocks` blocks), their float32 sums
    # added in order after (`_add_run_parts`, which also applies silu(gate) * up). 1 for every type: on an H100 at
    # 8 rows (skewed over 44 experts / copies of one row's 8) the int16 Q4_K gate+up took 48.4 / 35.0 us in 2 parts
    # against 46.5 / 36.6 in one, the Q6_K down 55.5 / 38.0 in 3 against 47.2 / 35.1; on the tensor cores the
    # fastest parts stayed 1.2-3x slower than the int16 or float sums but for Q8_0's down on 8 experts (36.0 / 40.4)
    run_parts: int = 1
    # sorted pairs a window of 2-8 rows has for each matvec program of a weight-row tile (1: a program a pair, which
    # computes its expert's run where it is the first of it, the later pairs of a run doing nothing: each an idle
    # program, its launch and loads of the routing holding a place on an SM). Above 1, fewer programs walk the
    # window's runs in turn, each found in the sorted experts, so fewer are idle; but a program's runs go one
    # after another, so too few lose on windows of many short runs (`for_stack` says where it pays)
    pairs_a_program: int = 1
    # windows of 2-8 rows (runs and pairs alone, off the tensor cores) take x rounded to int8 (`triton_xq`, ~250x
    # int16's rounding error, llama.cpp's rounding): Q4_K and Q6_K instead of int16 (half the bytes, dp4a's four
    # products an instruction), Q8_0 instead of float sums (dp4a, both signed); one-row windows, and so exact mode,
    # keep theirs. On for Q8_0 (H100, 8 rows: gate+up 123.4 -> 77.4 us on 50 experts, 65.8 -> 49.6 on 8, down
    # 78.7 -> 47.8 and 40.8 -> 30.7; bench-engine's copies 3,544 -> 4,211 tok/s, `--distinct` 2,381 -> 3,275, the
    # server's 8 concurrent 1,874 -> 2,375). Off for Q4_K and Q6_K: they gain where rows share experts (gate+up
    # 36.7 -> 31.1, down 35.2 -> 30.9; copies 4,117 -> 4,301) and little where they do not (44 experts: 46.7 -> 44.2,
    # 47.5 -> 45.0; `--distinct` 3,650 -> 3,666, the server unchanged)
    int8_windows: bool = False
    # runs of 2-8 pairs of Q4_K or Q6_K (gates and ups of one type), x in bf16 or f16, on tiles of x's dtype
    # dequantized in registers (`triton_tiles.tile_sums`: the weights' values as the grouped GEMMs take them, x as it
    # is, one tl.dot a tile), in programs of `mma_rows` weight rows, instead of the int8 products; elsewhere `mma_rows`
    # keeps those. Not yet timed on a GPU: off
    tile_runs: bool = False
    # with `tile_runs`, a pair alone on its expert in a window of 2-8 rows takes the tiles too (a run of one) instead
    # of the one-row sums; a window of one row keeps those. Not yet timed: off
    tile_alone: bool = False
    # a window of one row (every pair alone): weight rows per program, warps and blocks a step (None: as above)
    solo_rows: int | None = None
    solo_warps: int | None = None
    solo_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.mma_rows and (self.mma_rows < 16 or self.mma_rows & (self.mma_rows - 1)):
            raise ValueError(f"mma_rows must be 0 or a power of two of at least 16 (the tensor cores' tile), "
                             f"got {self.mma_rows}")
        if self.run_parts < 1:
            raise ValueError(f"run_parts must be at least 1, got {self.run_parts}")
        if self.pairs_a_program < 1:
            raise ValueError(f"pairs_a_program must be at least 1, got {self.pairs_a_program}")
        if self.tile_runs and not self.mma_rows:
            raise ValueError("tile_runs takes the tensor cores' programs: set mma_rows too")
        if self.tile_alone and not self.tile_runs:
            raise ValueError("tile_alone puts pairs alone on the runs' tiles: set tile_runs too")

    def mma_program(self, rows: int) -> int:
        """Weight rows of a tensor-core program for runs of 2-8 pairs, where programs have `rows` (the kernel's
        MMA: at least `mma_rows`, a multiple of `rows`); 0 where runs take the int16 sums."""
        return max(rows, self.mma_rows) if self.mma_rows else 0

    def joins(self, gate: Q, up: Q) -> bool:
        """Whether gates and ups of these types take one pass (`joint`: Q4_K's, measured faster)."""
        return self.joint and gate == up == Q.Q4_K

    @classmethod
    def for_stack(cls, qtype: Q, k: int, gated: bool) -> Tiles:
        # The fastest of a sweep on an H200 at qwen3-30b-a3b's expert shapes (decode windows of 1 and 8
        # rows, 512-row chunks; rows 2-8, k steps 128-512, tiles 16-64 x 64-128 x 64-128, 4 or 8 warps).
        # One-row windows: one weight row a program, one warp, 4 blocks a step (gate and up 21.7 -> 13.8 us,
        # the Q6_K down 17.3 -> 15.4 us against the 8-row tiles; one row a program, 1-8 warps and blocks swept).
        wide = 256 if qtype == Q.Q6_K and not gated else 512
        if qtype in FLOAT_BLOCKS:
            # F16 at these shapes, the float sums: 8 rows, one weight row a one-warp program (gate+up 114.7 -> 80.2
            # us, down 89.6 -> 83.3; what `mma_rows` 0 gives); one row, two (13.4 and 9.9 us against 14.9 and 12.5)
            # 2-8 rows on the tensor cores: tf32 tiles of 64 weight rows, 128 values a step, 4 warps (H100, 8 rows on
            # 46 experts / copies of one row's 8: gate+up 99.6 -> 97.9 / 63.5 -> 23.5 us, down 83.5 -> 51.6 /
            # 80.1 -> 11.6 against the float sums' one-warp programs of one weight row)
            return cls(1, min(512, triton.next_power_of_2(k)), 64, 64, 64, 4, 4, mma_rows=64, mma_k=128, solo_rows=2,
                       solo_warps=1, solo_blocks=4)
        if qtype in (Q.Q8_0, Q.Q6_K, Q.Q4_K):
            # One-warp programs over 2 (gate+up) or 4 (down) weight rows, in windows of 8 rows (skewed routing,
            # 51 experts, H200): Q4_K gate+up 122.6 -> 77.5 us, Q6_K down 107.8 -> 80.0, Q8_0 170.2 -> 121.7
            # and 107.6 -> 77.4. Four-warp programs spread their rows over warps, each warp loading the same
            # x values (82% of L1 busy, 15% of DRAM). A Q4_K down (k = 768) at 8 rows, a block a step, walking 4
            # pairs (H100, skewed over 51 experts / copies of one row's 8): 50.1 -> 33.2 / 39.8 -> 18.3 us against
            # four-warp programs of 8 rows, 2 blocks a step, a program a pair (4 rows walking 2: 30.1 / 23.2).
            # The Q4_K gate+up and the Q6_K down, their run sums reduced every step (`_sums`): a block a step over
            # more weight rows (H200, 8 rows, skewed over 44 experts / copies of one row's 8 experts, one call):
            # gate+up 4 rows, 60.8 -> 45.5 us / 37.5 -> 37.0 against 2 rows and 4 blocks; down 8 rows,
            # 67.3 -> 46.5 / 35.8 -> 35.2 against 4 rows and 4 blocks (what the others keep).
            # Programs walking the window's runs, half a program a sorted pair (`pairs_a_program` 2; H100, 8 rows,
            # skewed over 44-50 experts / copies of one row's 8, us): Q4_K gate+up 46.8 -> 44.1 / 36.7 -> 31.2 (on 51
            # experts 47.5 -> 48.0), the Q6_K down 47.5 -> 46.0 / 35.0 -> 25.3, Q8_0's down 48.4 -> 48.3 / 30.7 ->
            # 27.5. Fewer programs lost on skewed windows (4 to 16 pairs a program: 48.3-100.6 us for these), as
            # Q8_0's gate+up did at 2 (78.1 -> 84.8) and a Q4_K down of four-warp programs (50.4 -> 63.0)
            warps = 1
            if qtype == Q.Q4_K:
                rows, blocks, walk = (4, 1, 2) if gated else (8, 1, 4)
            elif qtype == Q.Q6_K and not gated:
                rows, blocks, walk = 8, 1, 2
            else:
                rows, blocks, walk = (2, 4, 1) if gated else (4, 4, 2)
        else:
            rows, warps, blocks, walk = (4 if gated else 8), 4, 1, 1  # float sums: `row_blocks` unread
        return cls(rows, min(wide, triton.next_power_of_2(k)), 64, 64, 64, warps, 4, blocks, solo_rows=1, solo_warps=1,
                   solo_blocks=4, int8_windows=qtype == Q.Q8_0, pairs_a_program=walk)


SKIP = -1  # slot table entry: the pair is computed elsewhere, its output row is left unwritten


def far_slot(index: int | torch.Tensor) -> int | torch.Tensor:
    """The slot table entry (or entries) that read entry `index` of the stack's `far` tensor."""
    return -2 - index


class Stack:
    """One projection of a layer's experts: `qtype` blocks, uint8 `[slots, n, row_bytes(qtype, k)]` on the
    kernels' device, and optionally `far`, uint8 `[entries, n, row_bytes]` the kernels read in place
    (pinned host memory on CUDA: every read crosses PCIe), checked once."""

    def __init__(self, qtype: Q, blocks: torch.Tensor, k: int, tiles: Tiles | None = None,
                 far: torch.Tensor | None = None):
        if qtype not in SUPPORTED + FLOAT_BLOCKS:
            names = ", ".join(t.name for t in SUPPORTED + FLOAT_BLOCKS)
            raise ValueError(f"{Q(qtype).name} has no Triton kernel (supported: {names})")
        for name, t in (("blocks", blocks), ("far", blocks if far is None else far)):
            if t.dtype != torch.uint8 or t.dim() != 3 or t.shape[1:] != blocks.shape[1:] or \
                    t.shape[2] != row_bytes(qtype, k):
                raise ValueError(f"{name} must be uint8 [slots, n, {row_bytes(qtype, k)}] for {qtype.name} with "
                                 f"k={k}, got {t.dtype} {tuple(t.shape)}")
            if not t.is_contiguous() or t.data_ptr() % 4:
                raise ValueError(f"{name} must be contiguous and start at a multiple of 4 bytes")
        self.qtype, self.blocks, self.k = qtype, blocks, k
        self.far = blocks if far is None else far
        self.slots, self.n, self.row_bytes = blocks.shape
        self.expert_bytes = self.n * self.row_bytes
        self._tiles = tiles  # None: from the shape
        if qtype in ROUNDED or (takes_tensor_cores(qtype, k) and (self.tiles(False).mma_rows or
                                                               self.tiles(True).mma_rows)):
            RoundedRows.want(blocks.device)

    def tiles(self, gated: bool) -> Tiles:
        return self._tiles or Tiles.for_stack(self.qtype, self.k, gated)

    def with_far(self, far: torch.Tensor) -> Stack:
        """The same stack reading its far entries from `far`."""
        return Stack(self.qtype, self.blocks, self.k, self._tiles, far)

    @property
    def gemm_m(self) -> int:
        """Pairs per GEMM tile (what `Routing.of` pads each expert's pairs to for this stack)."""
        return self.tiles(gated=False).gemm_m

    def type_args(self, suffix: str = "") -> dict[str, int | bool]:
        return type_args(self.qtype, suffix)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Every slot's weights as [slots, n, k] of `dtype` (not the `far` entries)."""
        return dequantize_blocks(self.qtype, self.blocks.view(-1, self.row_bytes), self.k, dtype).view(
            self.slots, self.n, self.k)


def type_args(qtype: Q, suffix: str = "") -> dict[str, int | bool]:
    """The kernels' compile-time arguments for blocks of `qtype` (`suffix` "2": the second matrix's)."""
    return {"QTYPE" + suffix: int(qtype), "GROUP" + suffix: GROUP[qtype], "HAS_MIN" + suffix: qtype in HAS_MIN}


@dataclass(frozen=True)
class Routing:
    """A window's (row, expert) pairs sorted by expert, made on the device from `ids` [m, top_k] without a
    host sync. A row's ids must be distinct (as top-k gives them): a decode window's program computes
    one expert's run of pairs, at most `MATVEC_ROWS` of them. `order[p]` is the flat pair (row * top_k + choice) at sorted position p, `experts[p]` its
    expert and `src[p]` its row of x. For prompt chunks (`gemm_m` set), each expert's pairs are padded
    to whole tiles: `padded[t * gemm_m + i]` is a sorted position or -1, `tile_expert[t]` the tile's
    expert or -1 for tiles past the last."""

    rows: int
    order: torch.Tensor
    experts: torch.Tensor
    src: torch.Tensor
    tile_expert: torch.Tensor | None = None
    padded: torch.Tensor | None = None

    @classmethod
    def of(cls, ids: torch.Tensor, n_experts: int, gemm_m: int | None = None) -> Routing:
        if ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"ids must be integer [rows, top_k], got {ids.dtype} {tuple(ids.shape)}")
        rows, top_k = ids.shape
        flat = ids.reshape(-1)
        if gemm_m is None and flat.numel() <= SORT_PAIRS_MAX:
            return cls(rows, *_sort_pairs(flat, top_k))
        return cls(rows, *_tile_pairs(flat.contiguous(), top_k, n_experts, gemm_m))


SORT_PAIRS_MAX = 128  # a decode window's pairs (8 rows of top-8: 64) sorted in one program


@triton.jit
def _sort_pairs_kernel(ids, order, experts, src, pairs, TOP_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """The stable sort of the pairs by expert: each pair's sorted position is the count of pairs before it
    (a lower expert, or the same expert at a lower flat index)."""
    pdl.wait(PDL)
    p = tl.arange(0, BLOCK)
    live = p < pairs
    e = tl.load(ids + p, mask=live, other=0)
    before = (e[None, :] < e[:, None]) | ((e[None, :] == e[:, None]) & (p[None, :] < p[:, None]))
    rank = tl.sum((before & live[None, :]).to(tl.int32), axis=1)
    tl.store(order + rank, p.to(tl.int64), mask=live)
    tl.store(experts + rank, e.to(tl.int32), mask=live)
    tl.store(src + rank, (p // TOP_K).to(tl.int32), mask=live)


@triton.jit
def _count_pairs_kernel(ids, counts, pairs, BE: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Chunk c's pairs of each expert into counts[c]."""
    pdl.wait(PDL)
    c = tl.program_id(0)
    p = c * CHUNK + tl.arange(0, CHUNK)
    e = tl.arange(0, BE)
    pe = tl.load(ids + p, mask=p < pairs, other=-1).to(tl.int32)
    tl.store(counts + c * BE + e, tl.sum((pe[None, :] == e[:, None]).to(tl.int32), axis=1))


@triton.jit
def _scan_pairs_kernel(counts, starts, tile_expert, chunks, n_experts, tiles, BE: tl.constexpr, SCAN: tl.constexpr,
                       CHUNK: tl.constexpr, GEMM_M: tl.constexpr, PDL: tl.constexpr):
    """One program: counts[c] becomes the pairs of each expert in the chunks before c; starts[0] each expert's
    first sorted position, and (GEMM_M > 0) starts[1] its first tile and each tile's expert."""
    pdl.wait(PDL)
    e = tl.arange(0, BE)
    total = tl.zeros((BE,), dtype=tl.int32)
    for c0 in range(0, chunks, SCAN):
        c = c0 + tl.arange(0, SCAN)[:, None]
        block = tl.load(counts + c * BE + e[None, :], mask=c < chunks, other=0)
        tl.store(counts + c * BE + e[None, :], tl.cumsum(block, axis=0) - block + total[None, :], mask=c < chunks)
        total += tl.sum(block, axis=0)
    tl.store(starts + e, tl.cumsum(total, axis=0) - total)
    if GEMM_M > 0:
        n_tiles = (total + GEMM_M - 1) // GEMM_M
        tile_end = tl.cumsum(n_tiles, axis=0)
        tl.store(starts + BE + e, tile_end - n_tiles)
        live_e = e < n_experts
        for t0 in range(0, tiles, CHUNK):  # a tile's expert: the experts whose tiles end at or before it
            t = t0 + tl.arange(0, CHUNK)
            before = tl.sum(((tile_end[:, None] <= t[None, :]) & live_e[:, None]).to(tl.int32), axis=0)
            tl.store(tile_expert + t, tl.where(before < n_experts, before, -1), mask=t < tiles)


@triton.jit
def _place_pairs_kernel(ids, counts, starts, order, experts, src, padded, pairs, TOP_K: tl.constexpr,
                        GEMM_M: tl.constexpr, BE: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Chunk c's pairs at their sorted positions: their expert's first position plus the pairs of that expert
    before them (in the chunks before, then in this one); (GEMM_M > 0) and in their expert's tiles."""
    pdl.wait(PDL)
    c = tl.program_id(0)
    p = c * CHUNK + tl.arange(0, CHUNK)
    live = p < pairs
    e = tl.arange(0, BE)
    pe = tl.load(ids + p, mask=live, other=-1).to(tl.int32)
    mine = (pe[None, :] == e[:, None]).to(tl.int32)  # [BE, CHUNK]
    seen = tl.load(counts + c * BE + e)
    rank = tl.sum(mine * (tl.cumsum(mine, axis=1) - 1 + seen[:, None]), axis=0)
    position = tl.sum(mine * tl.load(starts + e)[:, None], axis=0) + rank
    tl.store(order + position, p.to(tl.int64), mask=live)
    tl.store(experts + position, pe, mask=live)
    tl.store(src + position, (p // TOP_K).to(tl.int32), mask=live)
    if GEMM_M > 0:
        first_tile = tl.sum(mine * tl.load(starts + BE + e)[:, None], axis=0)
        tl.store(padded + first_tile * GEMM_M + rank, position, mask=live)


def _tile_pairs(flat: torch.Tensor, top_k: int, n_experts: int, gemm_m: int | None) -> tuple[torch.Tensor, ...]:
    """`_sort_pairs` for any number of pairs, and (with `gemm_m`) each expert's pairs padded to whole tiles:
    order, experts, src[, tile_expert, padded], in three launches over chunks of pairs after the padding's fill
    (count, scan, place; one program over every pair took 424 us for a 512-token chunk of qwen3-30b-a3b on an
    H200)."""
    pairs = flat.numel()
    order = torch.empty(pairs, dtype=torch.int64, device=flat.device)
    experts = torch.empty(pairs, dtype=torch.int32, device=flat.device)
    src = torch.empty(pairs, dtype=torch.int32, device=flat.device)
    # at most one partial tile per expert routed to
    tiles = 0 if gemm_m is None else triton.cdiv(pairs, gemm_m) + min(n_experts, pairs)
    tile_expert = torch.empty(tiles, dtype=torch.int32, device=flat.device)
    padded = torch.full((tiles * (gemm_m or 0),), -1, dtype=torch.int32, device=flat.device)
    if pairs:
        chunk, be = 64, triton.next_power_of_2(n_experts)
        chunks = triton.cdiv(pairs, chunk)
        counts = torch.empty(chunks, be, dtype=torch.int32, device=flat.device)
        starts = torch.empty(2, be, dtype=torch.int32, device=flat.device)
        launch = pdl.launch(flat.device)
        _count_pairs_kernel[(chunks,)](flat, counts, pairs, BE=be, CHUNK=chunk, num_warps=4, **launch)
        _scan_pairs_kernel[(1,)](counts, starts, tile_expert, chunks, n_experts, tiles, BE=be, SCAN=16, CHUNK=chunk,
                                 GEMM_M=gemm_m or 0, num_warps=4, **launch)
        _place_pairs_kernel[(chunks,)](flat, counts, starts, order, experts, src, padded, pairs, TOP_K=top_k,
                                       GEMM_M=gemm_m or 0, BE=be, CHUNK=chunk, num_warps=4, **launch)
    return (order, experts, src) if gemm_m is None else (order, experts, src, tile_expert, padded)


def _sort_pairs(flat: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`torch.argsort(flat, stable=True)`, the experts in that order and each pair's row, in one launch
    (torch takes five: the sort, a gather and three casts)."""
    pairs = flat.numel()
    order = torch.empty(pairs, dtype=torch.int64, device=flat.device)
    experts = torch.empty(pairs, dtype=torch.int32, device=flat.device)
    src = torch.empty(pairs, dtype=torch.int32, device=flat.device)
    if pairs:
        _sort_pairs_kernel[(1,)](flat.contiguous(), order, experts, src, pairs, TOP_K=top_k,
                                 BLOCK=max(16, triton.next_power_of_2(pairs)), num_warps=4, **pdl.launch(flat.device))
    return order, experts, src


def _check(x: torch.Tensor, k: int, device: torch.device, slot_of: torch.Tensor, routing: Routing) -> torch.Tensor:
    if x.dtype not in X_DTYPES or x.dim() != 2 or x.shape[1] != k or x.device != device or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous float32/bf16/f16 tensor [m, {k}] on {device}, "
                         f"got {x.dtype} {tuple(x.shape)} on {x.device}")
    if slot_of.dtype != torch.int32 or slot_of.dim() != 1 or slot_of.device != device:
        raise ValueError(f"slot_of must be an int32 vector on {device}, got {slot_of.dtype} "
                         f"{tuple(slot_of.shape)} on {slot_of.device}")
    if routing.experts.device != device:
        raise ValueError(f"the routing must be on {device}, got {routing.experts.device}")
    # Triton compiles a kernel per alignment of its pointers: every call must run one kernel
    return x.clone() if x.data_ptr() % 16 else x


def _run_parts(parts: int, w: Stack, other: Stack, mma: int, blocks_a_step: tuple[int, int]) -> int:
    """The parts a window's runs cut k into (`Tiles.run_parts`), refused where their path cannot: k in whole
    256-value steps (`steps_per_part`), on the int16 sums (Q4_K, Q6_K only) whole steps of `row_blocks` blocks."""
    if parts == 1:
        return 1
    if {w.qtype, other.qtype} & set(FLOAT_BLOCKS):
        raise ValueError(f"windows of {w.qtype.name} take all of k in one program: they cannot take {parts} parts")
    if not mma and not {w.qtype, other.qtype} <= set(ROUNDED):
        raise ValueError(f"runs of {w.qtype.name} off the tensor cores take float sums over all of k: they cannot "
                         f"take {parts} parts")
    per = steps_per_part(w.qtype, w.k, parts)
    if not mma and any(per % sb for sb in blocks_a_step):
        raise ValueError(f"runs of {w.qtype.name} over k={w.k} cannot take {parts} parts of {per} steps: the int16 "
                         f"sums take {blocks_a_step} blocks a step")
    return parts


def _run(w: Stack, w2: Stack | None, x: torch.Tensor, routing: Routing, slot_of: torch.Tensor,
         src: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    x = _check(x, w.k, w.blocks.device, slot_of, routing)
    pairs = routing.experts.numel()
    y = _output(out, (pairs, w.n), x)
    if not pairs:
        return y
    gated = w2 is not None
    other = w2 if gated else w
    tiles = w.tiles(gated)
    joint = gated and tiles.joins(w.qtype, other.qtype)
    sizes = (w.row_bytes, w.expert_bytes, other.row_bytes, other.expert_bytes)
    if routing.padded is None:
        if routing.rows > MATVEC_ROWS:
            raise ValueError(f"the matvec takes at most {MATVEC_ROWS} rows, got {routing.rows}: route prompt "
                             f"chunks with gemm_m")
        solo = routing.rows == 1 and tiles.solo_rows is not None
        rows, warps, sb = ((tiles.solo_rows, tiles.solo_warps, tiles.solo_blocks) if solo else
                           (tiles.matvec_rows, tiles.matvec_warps, tiles.row_blocks))
        sb2 = other.tiles(gated).solo_blocks if solo else other.tiles(gated).row_blocks
        floats = w.qtype == other.qtype and w.qtype in FLOAT_BLOCKS  # `_float_mma` reads both as w's type
        on_tensor_cores = not solo and routing.rows > 1 and (floats or takes_tensor_cores(w.qtype, w.k) and
                                                             takes_tensor_cores(other.qtype, other.k))
        mma = tiles.mma_program(rows) if on_tensor_cores else 0
        tile_runs = bool(mma) and takes_tile_runs(tiles, w, other, x.dtype)
        rows, step, alone = matvec_program(tiles, floats, rows, mma, tile_runs)
        n_parts = 1 if solo else _run_parts(tiles.run_parts, w, other, mma, (sb, sb2))
        # the kernel takes the rounded rows' pointers whatever the types; the float sums never read them
        rounding = x_rounding(w, other, gated, routing.rows, mma)
        rounded = RoundedRows.of(x, rounding) if rounding else RoundedRows(x, x, x, x)
        parts = (torch.empty(n_parts, 1 + gated, pairs, w.n, dtype=torch.float32, device=x.device) if n_parts > 1
                 else y)
        walk, walking = walk_program(tiles, solo, pairs // routing.rows)
        _moe_matvec_kernel[(triton.cdiv(w.n, rows), triton.cdiv(pairs, walk), n_parts)](
            w.blocks, other.blocks, w.far, other.far, slot_of, routing.experts, src, routing.order, x, rounded.q,
            rounded.scale, rounded.sums, rounded.halves, y, parts, pairs, w.n, w.k, *sizes, **w.type_args(),
            **other.type_args("2"), GATED=gated, JOINT=joint, R=rows, BK=step, ROWS=MATVEC_ROWS, SB=sb, SB2=sb2,
            ASM=ASM, MMA=mma, ALONE=alone, PARTS=n_parts, **walking, TILE_RUNS=tile_runs, num_warps=warps,
            **_FUSED, **pdl.launch(x.device))
        if n_parts > 1:
            block = 256
            _add_run_parts[(pairs, triton.cdiv(w.n, block))](parts, y, routing.experts, slot_of, routing.order, pairs,
                                                             w.n, GATED=gated, PARTS=n_parts, BLOCK=block,
                                                             **pdl.launch(x.device))
    else:
        if routing.padded.numel() != routing.tile_expert.numel() * tiles.gemm_m:
            raise ValueError(f"the routing's tiles are not of {tiles.gemm_m} pairs: Routing.of(ids, experts, "
                             f"stack.gemm_m)")
        grid = (routing.tile_expert.numel(), triton.cdiv(w.n, tiles.gemm_n))
        args = {key: v for key, v in (w.type_args() | other.type_args("2")).items() if not key.startswith("HAS")}
        _moe_gemm_kernel[grid](w.blocks, other.blocks, w.far, other.far, slot_of, routing.tile_expert, routing.padded, src,
                               routing.order, x, y,
                               w.n, w.k, *sizes, **args, GATED=gated, JOINT=joint, BM=tiles.gemm_m, BN=tiles.gemm_n,
                               BK=tiles.gemm_k, num_warps=tiles.gemm_warps, **_FUSED,
                               **pdl.launch(x.device))
    return y


def matvec_program(tiles: Tiles, floats: bool, rows: int, mma: int, tile_runs: bool = False) -> tuple[int, int, bool]:
    """A decode window's (weight rows a program, values of k a step, whether pairs alone take the one-row sums),
    for tiles whose programs have `rows` rows and runs `mma` (`Tiles.mma_program`; 0: off the tensor cores): F16 and
    BF16 windows (`floats`) on the tensor cores put every pair on tf32 tiles, in programs of `mma` rows; where runs
    take tiles of x's dtype (`tile_runs`), `Tiles.tile_alone` puts the pairs alone on them too."""
    if floats and mma:
        return mma, tiles.mma_k, False
    return rows, tiles.matvec_k, not (tile_runs and tiles.tile_alone)


def takes_tile_runs(tiles: Tiles, w: Stack, other: Stack, dtype: torch.dtype) -> bool:
    """Whether a window's runs on the tensor cores take tiles of x's dtype (`Tiles.tile_runs`): stacks of one type
    that has them (Q4_K, Q6_K), x in bf16 or f16; else they take the int8 products."""
    return tiles.tile_runs and w.qtype == other.qtype and w.qtype in TILE_TYPES and dtype in HALF_DTYPES


def walk_program(tiles: Tiles, solo: bool, top_k: int) -> tuple[int, dict[str, int | bool]]:
    """A decode window's sorted pairs a matvec program (`Tiles.pairs_a_program`; 1 for a one-row window, `solo`)
    and the kernel's WALKS and PAIRS (the sorted experts' block, the largest window's: every window of a model's
    top-k compiles one kernel), for `_run` and `sass`."""
    walk = 1 if solo else tiles.pairs_a_program
    return walk, dict(WALKS=walk > 1, PAIRS=triton.next_power_of_2(top_k if solo else MATVEC_ROWS * top_k))


def x_rounding(w: Stack, other: Stack, gated: bool, rows: int, mma: int) -> torch.dtype | None:
    """What a matvec window of `rows` rows through w (and `other`, its ups or itself) rounds x to: int8 where the
    tiles say `int8_windows` for windows of 2-8 rows off the tensor cores (`mma` 0), int16 for the tensor cores'
    int8 runs and the `ROUNDED` types, None where the float sums or the F16 and BF16 tf32 tiles take x as it is."""
    types = {w.qtype, other.qtype}
    if rows > 1 and not mma and w.tiles(gated).int8_windows and types <= INT8_TYPES:
        return torch.int8
    return torch.int16 if (mma and not types <= set(FLOAT_BLOCKS)) or types & set(ROUNDED) else None


def _output(out: torch.Tensor | None, shape: tuple[int, int], x: torch.Tensor) -> torch.Tensor:
    """`out` when given (checked: the kernels write its rows in place), else a new tensor."""
    if out is None:
        return torch.empty(shape, dtype=x.dtype, device=x.device)
    if tuple(out.shape) != shape or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {x.dtype} tensor {list(shape)} on {x.device}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    return out


def swiglu(gate: Stack, up: Stack, x: torch.Tensor, routing: Routing, slot_of: torch.Tensor,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) for every routed pair, in flat (row, choice) order: [pairs, n] in x's dtype
    (into `out` when given: the pairs the table skips keep what it held)."""
    if (gate.n, gate.k, gate.slots) != (up.n, up.k, up.slots):
        raise ValueError(f"gate {gate.slots}x{gate.n}x{gate.k} and up {up.slots}x{up.n}x{up.k} differ in shape")
    return _run(gate, up, x, routing, slot_of, routing.src, out)


def project(w: Stack, h: torch.Tensor, routing: Routing, slot_of: torch.Tensor,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """h [pairs, k] (one row per routed pair, in flat (row, choice) order) @ its expert's W.T: [pairs, n] in
    h's dtype, in the same order (into `out` when given, as `swiglu`)."""
    if h.shape[0] != routing.experts.numel():
        raise ValueError(f"h must have one row per routed pair ({routing.experts.numel()}), got {h.shape[0]}")
    return _run(w, None, h, routing, slot_of, routing.order, out)


@dataclass(frozen=True)
class Outputs:
    """Where `swiglu_experts` writes: the SwiGLU rows `h` [pairs, ffn] and the outputs `y` [pairs, hidden].
    Passes over the same pairs share them: each pass writes only the pairs its table does not skip."""

    h: torch.Tensor
    y: torch.Tensor

    @classmethod
    def new(cls, pairs: int, gate: Stack, down: Stack, x: torch.Tensor) -> Outputs:
        """Empty buffers for `pairs` pairs of a layer whose gate and down stacks these are, rows like `x`."""
        return cls(torch.empty(pairs, gate.n, dtype=x.dtype, device=x.device),
                   torch.empty(pairs, down.n, dtype=x.dtype, device=x.device))


def swiglu_experts(gate: Stack, up: Stack, down: Stack, x: torch.Tensor, ids: torch.Tensor,
                   slot_of: torch.Tensor, routing: Routing | None = None,
                   out: Outputs | None = None) -> tuple[torch.Tensor, Routing]:
    """A layer's SwiGLU experts over a window's routed pairs (`ids` [rows, top_k]): a decode window takes the
    matvec, a prompt chunk the GEMM (each expert's pairs padded to its tiles). Returns the outputs in flat
    (row, choice) order, [rows * top_k, hidden] (`out.y` when given), and the routing (`routing`: made
    already, by `routing_of`)."""
    routing = routing or routing_of(ids, slot_of.numel(), gate.gemm_m)
    h = swiglu(gate, up, x.contiguous(), routing, slot_of, out.h if out else None)
    return project(down, h, routing, slot_of, out.y if out else None), routing


def routing_of(ids: torch.Tensor, experts: int, gemm_m: int) -> Routing:
    """The routing `swiglu_experts` takes: a decode window's pairs sorted, a prompt chunk's also padded to
    GEMM tiles of `gemm_m` pairs."""
    return Routing.of(ids, experts, None if ids.shape[0] <= MATVEC_ROWS else gemm_m)


STAGE_CHUNK = 4096  # bytes a program copies of each projection: ~46 GB/s from pinned host memory on an H200,
# as the copy engine, where the matvec's own reads of the same experts reach ~21 GB/s


@triton.jit
def _copy_chunk(src, dst, src_entry, dst_entry, size, at):
    live = at < size
    tl.store(dst + dst_entry * size + at, tl.load(src + src_entry * size + at, mask=live), mask=live)


@triton.jit
def _stage_kernel(src0, src1, src2, dst0, dst1, dst2, slot_of, staged_of, experts, pairs, size0, size1, size2,
                  CHUNK: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """For sorted pair p, the first of its expert's run: `staged_of[e]` its slot when cached, else the
    next free staging entry (its rank among the window's far experts in sorted order), into which chunk
    program_id(1) of its three projections' blocks is copied from its far entry."""
    pdl.wait(PDL)
    p = tl.program_id(0)
    e, slot, first = _run_start(experts, slot_of, p)
    if first & (slot >= -1):
        if tl.program_id(1) == 0:
            tl.store(staged_of + e, slot)
    elif first:
        q = tl.arange(0, BLOCK)
        live = q < pairs
        eq = tl.load(experts + q, mask=live, other=-1)
        runs = live & (eq != tl.load(experts + q - 1, mask=live & (q > 0), other=-1))
        rank = tl.sum((runs & (q < p) & (tl.load(slot_of + eq, mask=runs, other=0) < -1)).to(tl.int32))
        if tl.program_id(1) == 0:
            tl.store(staged_of + e, -2 - rank)
        src, dst = (-2 - slot).to(tl.int64), rank.to(tl.int64)
        at = tl.program_id(1).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
        _copy_chunk(src0, dst0, src, dst, size0, at)
        _copy_chunk(src1, dst1, src, dst, size1, at)
        _copy_chunk(src2, dst2, src, dst, size2, at)


def stage_far(stacks: tuple[Stack, Stack, Stack], staged: tuple[Stack, Stack, Stack], slot_of: torch.Tensor,
              routing: Routing, staged_of: torch.Tensor) -> None:
    """Copy the far experts of a decode window (`slot_of[e]` a `far_slot`) from each of `stacks`' far tensors
    into `staged`'s (VRAM), one entry after another in the order of their expert ids, on the device: whole
    experts at the link's speed, with no host sync, so the kernels then read them from VRAM. `staged_of`
    (int32 [experts] on the device) becomes the table those kernels take: each routed expert's slot, or its
    staging entry. `staged` are `stacks` with other far tensors, of at least as many entries as the window
    has pairs (or experts)."""
    pairs = routing.experts.numel()
    if pairs > SORT_PAIRS_MAX:
        raise ValueError(f"stage_far stages a decode window's pairs (at most {SORT_PAIRS_MAX}), got {pairs}")
    if any(t.far.shape[1:] != s.far.shape[1:] or t.far.shape[0] < min(pairs, s.far.shape[0])
           for s, t in zip(stacks, staged, strict=True)):
        raise ValueError("the staging tensors must hold an entry for each of the window's pairs (or experts), "
                         "in the stacks' shapes")
    if pairs:
        chunks = triton.cdiv(max(s.expert_bytes for s in stacks), STAGE_CHUNK)
        _stage_kernel[(pairs, chunks)](*(s.far for s in stacks), *(t.far for t in staged), slot_of, staged_of,
                                       routing.experts, pairs, *(s.expert_bytes for s in stacks), CHUNK=STAGE_CHUNK,
                                       BLOCK=triton.next_power_of_2(pairs), num_warps=4, **pdl.launch(slot_of.device))


@triton.jit
def _weighted_sum_kernel(y, weights, at, residual, out, h, K: tl.constexpr, BLOCK: tl.constexpr,
                         AT: tl.constexpr, RESIDUAL: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in tl.static_range(K):  # choices in their order: a row's sum whatever the other rows
        pair = r * K + i
        if AT:  # y in another order: the pair's row of it
            pair = tl.load(at + pair)
        acc += tl.load(weights + r * K + i).to(tl.float32) * tl.load(y + pair * h + cols, mask=cols < h,
                                                                      other=0.0).to(tl.float32)
    total = acc.to(out.dtype.element_ty)
    if RESIDUAL:  # rounded to y's dtype first, then added and rounded again: the bits of `residual + sum`
        total = (tl.load(residual + r * h + cols, mask=cols < h, other=0.0).to(tl.float32) +
                 total.to(tl.float32)).to(out.dtype.element_ty)
    tl.store(out + r * h + cols, total, mask=cols < h)


def weighted_sum(y: torch.Tensor, weights: torch.Tensor, residual: torch.Tensor | None = None,
                 at: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's k outputs (y [rows * k, H], flat (row, choice) order, or with `at` (int64 [rows * k]) flat
    pair p's output is y's row at[p]) times its weights [rows, k], summed in float32 in the order of choices:
    [rows, H] in y's dtype, one launch. With `residual` ([rows, H], y's dtype), `residual + ` that sum, bit
    for bit, in the same launch."""
    n, k = weights.shape
    if y.dim() != 2 or y.shape[0] != n * k:
        raise ValueError(f"y must be [rows * top_k = {n * k}, H], got {tuple(y.shape)}")
    if at is not None and (at.shape != (n * k,) or at.dtype != torch.int64 or at.device != y.device):
        raise ValueError(f"at must be int64 [{n * k}] on {y.device}, got {at.dtype} {tuple(at.shape)} on {at.device}")
    if residual is not None and (residual.shape != (n, y.shape[1]) or residual.dtype != y.dtype):
        raise ValueError(f"residual must be {y.dtype} [{n}, {y.shape[1]}], got {residual.dtype} "
                         f"{tuple(residual.shape)}")
    y, weights = y.contiguous(), weights.contiguous()
    out = torch.empty(n, y.shape[1], dtype=y.dtype, device=y.device)
    if n:
        block = min(1024, triton.next_power_of_2(y.shape[1]))
        _weighted_sum_kernel[(n, triton.cdiv(y.shape[1], block))](
            y, weights, weights if at is None else at.contiguous(), y if residual is None else residual.contiguous(),
            out, y.shape[1], K=k, BLOCK=block, AT=at is not None, RESIDUAL=residual is not None, num_warps=4,
            enable_fp_fusion=False, **pdl.launch(y.device))
    return out


@triton.jit
def _router_kernel(x, router, logits, e, h, BE: tl.constexpr, BH: tl.constexpr, PDL: tl.constexpr):
    """logits[r, experts of this program] = x[r] . router[expert], float32, one order over h."""
    pdl.wait(PDL)
    r = tl.program_id(0).to(tl.int64)
    experts = tl.program_id(1) * BE + tl.arange(0, BE)[:, None]
    acc = tl.zeros((BE, BH), dtype=tl.float32)
    for c0 in range(0, h, BH):
        cols = c0 + tl.arange(0, BH)[None, :]
        xv = tl.load(x + r * h + cols, mask=cols < h, other=0.0).to(tl.float32)
        acc += tl.load(router + experts * h + cols, mask=(experts < e) & (cols < h), other=0.0) * xv
    tl.store(logits + r * e + tl.arange(0, BE) + tl.program_id(1) * BE, tl.sum(acc, axis=1),
             mask=tl.program_id(1) * BE + tl.arange(0, BE) < e)


@triton.jit
def _router_tiles_kernel(x, router, logits, n, e, h, BM: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr,
                         PDL: tl.constexpr):
    """logits of BM rows x BE experts: float32 products on the tensor cores as three tf32 products each (tl.dot in
    "tf32x3" precision: x and the router split into a tf32 part and the rest), summed over h in steps of BK, each
    row's dots in one order whatever the other rows."""
    pdl.wait(PDL)
    rows = tl.program_id(0) * BM + tl.arange(0, BM)[:, None]
    experts = tl.program_id(1) * BE + tl.arange(0, BE)[:, None]
    acc = tl.zeros((BM, BE), dtype=tl.float32)
    for c0 in range(0, h, BK):
        cols = c0 + tl.arange(0, BK)[None, :]
        xt = tl.load(x + rows.to(tl.int64) * h + cols, mask=(rows < n) & (cols < h), other=0.0).to(tl.float32)
        wt = tl.load(router + experts * h + cols, mask=(experts < e) & (cols < h), other=0.0)
        acc = tl.dot(xt, tl.trans(wt), acc, input_precision="tf32x3")
    tl.store(logits + rows.to(tl.int64) * e + tl.trans(experts), acc, mask=(rows < n) & (tl.trans(experts) < e))


@triton.jit
def _top_k_kernel(logits, weights, ids, e, K: tl.constexpr, BE: tl.constexpr, NORMALIZE: tl.constexpr,
                  PDL: tl.constexpr):
    """A row's softmax over its logits, then its k largest probabilities (ties: the lower expert first),
    normalized to sum 1 when NORMALIZE."""
    pdl.wait(PDL)
    r = tl.program_id(0).to(tl.int64)
    at = tl.arange(0, BE)
    v = tl.load(logits + r * e + at, mask=at < e, other=float("-inf"))
    p = tl.exp(v - tl.max(v, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where(at < e, p, -1.0)
    total = 0.0
    for i in tl.static_range(K):
        best = tl.max(p, axis=0)
        pick = tl.min(tl.where(p == best, at, BE), axis=0)
        tl.store(ids + r * K + i, pick.to(tl.int64))
        tl.store(weights + r * K + i, best)
        total += best
        p = tl.where(at == pick, -1.0, p)
    if NORMALIZE:
        got = tl.load(weights + r * K + tl.arange(0, K))
        tl.store(weights + r * K + tl.arange(0, K), got / total)


# rows from which a call's logits come in tiles of rows and experts (`_router_tiles_kernel`) instead of a program per
# (row, expert), which reads the router again for every row. H100, qwen3-30b-a3b's router (128 x 2048), us a call,
# the kernel / tiles in tf32x3 / in float32 on the FMA units ("ieee", 32 x 32 x 64): 512 rows 69.8 / 39.7 / 87.2,
# 1,024 136.8 / 39.1 / 86.7, 3,440 436.2 / 52.8 / 316.2, 8,192 1,039.1 / 82.6 / 640.4; the same top-8 experts as
# float32's in every row, logits within 3.1e-6 of torch's float32 GEMM (ieee's 1.1e-5). torch's GEMM took 19-148
# us, but the server's reads with it came out slower while new row counts came, every prompt having its own
ROUTER_TILE_ROWS = 512
ROUTER_TILES = dict(BM=64, BE=32, BK=32)


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`engine.experts.route` in two launches: x [N, H] (any float dtype) against the float32 router
    [E, H]; weights float32 [N, k] and ids int64 [N, k], each row on its own."""
    n, h = x.shape
    e = router.shape[0]
    if router.shape[1] != h or top_k > e or top_k & (top_k - 1):
        raise ValueError(f"router [E, {h}] with top_k a power of two <= E, got {tuple(router.shape)}, {top_k}")
    x, router = x.contiguous(), router.contiguous()
    weights = torch.empty(n, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(n, top_k, dtype=torch.int64, device=x.device)
    logits = torch.empty(n, e, dtype=torch.float32, device=x.device)
    if n >= ROUTER_TILE_ROWS:
        bm, be = ROUTER_TILES["BM"], ROUTER_TILES["BE"]
        _router_tiles_kernel[(triton.cdiv(n, bm), triton.cdiv(e, be))](x, router, logits, n, e, h, **ROUTER_TILES,
                                                                      num_warps=4, **pdl.launch(x.device))
    elif n:
        # an expert a program and its whole row in one step: each program issues all its loads at once (two
        # experts a program in steps of 256 took 5.0 us a one-row call)
        be = 1
        _router_kernel[(n, triton.cdiv(e, be))](x, router, logits, e, h, BE=be, BH=min(4096, triton.next_power_of_2(h)),
                                                 num_warps=4, enable_fp_fusion=False, **pdl.launch(x.device))
    if n:
        _top_k_kernel[(n,)](logits, weights, ids, e, K=top_k, BE=triton.next_power_of_2(e), NORMALIZE=normalize,
                            num_warps=1, **pdl.launch(x.device))
    return weights, ids


def _bench() -> None:
    """qwen3-30b-a3b's experts (hidden 2048, expert FFN 768, 128 experts, top-8): the fused kernel's time,
    weight GB/s (the routed experts' bytes over time) and TFLOP/s for decode windows of 1 and 8 rows and
    a 512-row prompt chunk, beside torch's bf16 grouped GEMMs (`torch._grouped_mm`, as `ResidentExperts`,
    the gather of x and the silu included); each the mean of triton.testing.do_bench, L2 flushed."""
    import torch.nn.functional as F
    from triton.testing import do_bench

    from engine.kernels.triton_blocks import random_blocks

    hidden, ff, experts, top_k = 2048, 768, 128, 8
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"experts {experts} x (gate, up {ff}x{hidden}; down {hidden}x{ff}), top-{top_k}")
    gen = torch.Generator().manual_seed(0)
    slot_of = torch.arange(experts, dtype=torch.int32, device="cuda")
    dense = [torch.randn(experts, ff, hidden, device="cuda", dtype=torch.bfloat16) * 0.02,
             torch.randn(experts, ff, hidden, device="cuda", dtype=torch.bfloat16) * 0.02,
             torch.randn(experts, hidden, ff, device="cuda", dtype=torch.bfloat16) * 0.02]

    def grouped(x: torch.Tensor, routing: Routing) -> torch.Tensor:
        xs = x[routing.src.long()]
        counts = torch.zeros(experts, dtype=torch.int64, device="cuda").scatter_add_(
            0, routing.experts.long(), torch.ones_like(routing.experts, dtype=torch.int64))
        offs = torch.cumsum(counts, 0).to(torch.int32)
        g = torch._grouped_mm(xs, dense[0].transpose(1, 2), offs=offs)
        u = torch._grouped_mm(xs, dense[1].transpose(1, 2), offs=offs)
        return torch._grouped_mm(F.silu(g) * u, dense[2].transpose(1, 2), offs=offs)

    for qtype in (None, Q.F16, Q.Q8_0, Q.Q4_K, Q.Q6_K):
        if qtype is not None:
            stacks = [Stack(qtype, random_blocks(qtype, experts * n, k, gen).view(experts, n, -1).cuda(), k)
                      for n, k in ((ff, hidden), (ff, hidden), (hidden, ff))]
            expert_bytes = sum(s.expert_bytes for s in stacks)
        else:
            expert_bytes = 3 * ff * hidden * 2
        for m in (1, 8, 512):
            x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
            ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(m)]).cuda()
            routed = ids.unique().numel()
            if qtype is None:
                routing = Routing.of(ids, experts)
                seconds = do_bench(lambda x=x, routing=routing: grouped(x, routing)) * 1e-3
            else:
                routing = Routing.of(ids, experts, None if m <= MATVEC_ROWS else stacks[0].gemm_m)

                def fused(x=x, routing=routing, stacks=stacks):
                    h = swiglu(stacks[0], stacks[1], x, routing, slot_of)
                    return project(stacks[2], h, routing, slot_of)
                seconds = do_bench(fused) * 1e-3
            name = "bf16 torch" if qtype is None else qtype.name
            kind = "decode" if m <= MATVEC_ROWS else "prompt"
            flops = 2 * m * top_k * 3 * ff * hidden
            print(f"{name:10} {kind} m={m:<3} {routed:3} experts {seconds * 1e6:8.1f} us "
                  f"{routed * expert_bytes / seconds / 1e9:7.1f} GB/s {flops / seconds / 1e12:6.1f} TFLOP/s")


if __name__ == "__main__":
    _bench()
