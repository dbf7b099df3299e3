"""`python -m engine.kernels.sweep [SECONDS] [--runs] [--float] [--copies] [--tile-runs] [--tiles]`: the decode tile
sweeps behind `triton_blocks` and `triton_moe.Tiles` on a CUDA device, within a time limit (each configuration
compiles once: 1-5 s, ~13 s for the MoE kernel): the fused MoE kernel on a window of 8 rows (gate+up with and without
`Tiles.joint`, down, then windows on int8 x (`Tiles.int8_windows`), runs in parts of k (`Tiles.run_parts`) on the
tensor cores (`Tiles.mma_rows`) and on the int16 sums, programs walking pairs (`Tiles.pairs_a_program`); skewed
routing, then every row on the same experts as `bench-engine`'s 8 rows), the int16 dense kernel (`_rounded_kernel`:
weight rows a program, blocks a step, warps) at qwen3-30b-a3b's Q6_K head and dense shapes for 8 rows and for one, the
Q8_0 head's float-sum tiles, the dense shapes' 8 rows on the tensor cores (k in parts), then the MoE kernel's one-row
windows. `--copies`: the dense shapes' 1-8 rows on the blocks' kernels against torch's product on a bf16 copy
(`engine.dense_copies`), the layers' shapes' 8 rows on tiles dequantized from the blocks (`triton_tiles`,
`DENSE_TILES`), then the Q6_K head's 8 rows unpacked (`triton_unpacked`, `UNPACKED_TILES`) and on tiles
(`HEAD_TILES`). Each figure is one call replayed from a CUDA graph (`triton.testing.do_bench_cudagraph`); each shape's
configurations are printed fastest first, the one the code uses marked. `--runs`: the MoE's int8 windows and runs in
parts of k alone, beside the code's tiles, for the Q4_K_M mix and Q8_0. `--float`: F16 experts' windows of 8 rows on
the tensor cores (`float_window`). `--tile-runs`: the MoE's runs of 8-row windows on tiles of x's dtype
(`tile_runs_window`, `TILE_RUNS`). `--tiles`: every form on tiles (`dense_tiles`, `unpacked_head`, then
`--tile-runs`'s)."""

from __future__ import annotations

import dataclasses
import itertools
import sys
import time
from collections.abc import Callable

import torch
import triton
from gguf import GGMLQuantizationType as Q
from triton.testing import do_bench_cudagraph

from engine.kernels import triton_blocks as tb
from engine.kernels import triton_moe as tm
from engine.kernels.triton_tiles import BlockTiles, TileLaunch
from engine.kernels.triton_unpacked import Unpacked, UnpackedTiles
from engine.kernels.triton_xq import ASM, RoundedRows

DENSE = ((Q.Q6_K, 151936, 2048), (Q.Q4_K, 5120, 2048), (Q.Q4_K, 2048, 4096), (Q.Q6_K, 512, 2048))
HIDDEN, FF, EXPERTS, TOP_K = 2048, 768, 128, 8
Q8_0_DENSE = ((Q.Q8_0, 5120, 2048), (Q.Q8_0, 2048, 4096), (Q.Q8_0, 512, 2048), (Q.Q8_0, 151936, 2048))
CHOICES = (1, 2, 4, 8)
MMA_RUNS = ((16, 1, 4), (16, 1, 8), (16, 1, 2), (32, 1, 4), (32, 2, 4), (16, 2, 4), (16, 1, 1), (32, 2, 1))
INT16_PARTS = (2, 4, 8)
WALKS = (1, 2, 4, 8)  # sorted pairs a matvec program (`Tiles.pairs_a_program`)
INT8_TILES = ((4, 1, 1), (8, 1, 1), (2, 1, 1), (4, 2, 1), (16, 1, 1), (8, 1, 2))
FLOAT_TILES = ((16, 128, 1), (16, 64, 1), (16, 256, 1), (32, 128, 1), (32, 64, 2), (32, 128, 2), (64, 64, 4),
               (64, 128, 4), (16, 128, 2))  # weight rows a program, values a step, warps
INT8_Q8_0_TILES = ((2, 512, 1), (4, 512, 1), (2, 256, 1), (4, 256, 1), (8, 256, 1), (1, 512, 1))  # rows, values, warps
WITHOUT = "without tensor cores"
# the unpacked head's tiles (`unpacked_head`): weight rows a program, values a step, warps, stages
UNPACKED_TILES = ((64, 128, 4, 3), (32, 256, 4, 3), (64, 128, 4, 2), (32, 256, 2, 3), (128, 128, 8, 3), (64, 256, 8, 3),
                  (32, 128, 2, 3), (64, 128, 4, 4), (128, 64, 4, 3), (64, 64, 2, 3), (128, 128, 4, 3), (16, 256, 2, 3),
                  (32, 512, 4, 2), (128, 256, 8, 2))
# the dense shapes' launches on tiles (`dense_tiles`): weight rows a program, warps, stages, parts of k
DENSE_TILES = ((32, 4, 3, 1), (32, 2, 3, 1), (16, 1, 3, 1), (16, 2, 3, 1), (64, 4, 3, 1), (32, 4, 3, 2), (16, 2, 3, 2),
               (32, 2, 3, 2), (32, 4, 3, 4), (16, 2, 3, 4), (16, 1, 3, 4), (64, 4, 3, 2), (64, 4, 3, 4), (32, 4, 2, 2),
               (32, 4, 4, 2), (16, 1, 2, 4), (32, 2, 2, 4), (64, 8, 3, 2), (32, 4, 3, 8), (16, 2, 3, 8), (16, 1, 2, 8))
LAYERS = 12  # matrices a shape in `dense_tiles`: a 12-layer model's, more bytes than the L2 holds
# the Q6_K head's launches on tiles from its blocks (`unpacked_head`): weight rows a program, warps, stages, parts
HEAD_TILES = ((32, 4, 3, 1), (64, 4, 3, 1), (32, 2, 3, 1), (64, 8, 3, 1), (128, 8, 3, 1), (16, 2, 3, 1), (64, 4, 2, 1),
              (128, 4, 3, 1))
# runs on tiles of x's dtype (`tile_runs_window`): `Tiles.mma_rows`, warps, parts of k (the down's 768 values: 3 parts
# for any above 1), whether pairs alone take them too (`Tiles.tile_alone`)
TILE_RUNS = ((16, 1, 1, False), (32, 1, 1, False), (32, 2, 1, False), (64, 2, 1, False), (64, 4, 1, False),
             (16, 1, 1, True), (32, 2, 1, True), (64, 4, 1, True), (16, 2, 1, False), (32, 4, 1, False),
             (16, 1, 2, False), (32, 2, 2, False), (32, 1, 4, False), (64, 4, 2, False), (128, 4, 1, False))


def _us(fn: Callable[[], object]) -> float:
    fn()
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=30) * 1e3


def _report(name: str, times: dict[tuple[int, ...], float], used: tuple[int, ...],
            legend: str = "rows a program, blocks a step, warps") -> None:
    print(f"{name}  ({legend}; * = the code's choice)")
    for config, us in sorted(times.items(), key=lambda item: item[1]):
        print(f"  {'*' if config == used else ' '} {config}  {us:8.1f} us")


def _dense(qtype: Q, n: int, k: int, m: int, deadline: float, gen: torch.Generator) -> None:
    mat = tb.Matrix(qtype, tb.random_blocks(qtype, n, k, gen).cuda(), k)
    rounded = RoundedRows.of(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)

    def call(rows: int, blocks: int, warps: int) -> None:
        tb._rounded_kernel[(triton.cdiv(n, rows),)](
            mat.blocks, rounded.q, rounded.scale, rounded.sums, rounded.halves, y, m, n, k, mat.blocks.shape[1],
            QTYPE=int(qtype), R=rows, SB=blocks, ROWS=1 if m == 1 else tb.MATVEC_ROWS, ASM=ASM, num_warps=warps,
            PDL=False)

    used = mat._one_row if m == 1 else mat._rows
    times = {}
    for config in [used] + [c for c in _configs(CHOICES + (16,), CHOICES, CHOICES[:3]) if c != used]:
        if config != used and time.monotonic() > deadline:  # the code's choice is always timed
            break
        times[config] = _us(lambda config=config: call(*config))
    _report(f"{qtype.name} {n}x{k}, {m} rows", times, used)


def _configs(rows: tuple[int, ...], blocks: tuple[int, ...], warps: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(rows a program, blocks a step, warps), fewest warps first: one-warp programs keep a program's weight
    rows in each thread, so x is loaded once for all of them (the fastest at 8 rows so far)."""
    return sorted(itertools.product(rows, blocks, warps), key=lambda c: (c[2], c[0], c[1]))


def dense(m: int, deadline: float) -> None:
    gen = torch.Generator().manual_seed(0)
    for qtype, n, k in DENSE:
        _dense(qtype, n, k, m, deadline, gen)


def q8_head(deadline: float) -> None:
    """The Q8_0 head's float-sum tiles (`Matrix._float_row` for one row, `Matrix._small_gemm` for 8)."""
    n, k = 151936, HIDDEN
    mat = tb.Matrix(Q.Q8_0, tb.random_blocks(Q.Q8_0, n, k, torch.Generator().manual_seed(2)).cuda(), k)
    for m, attr, choices in ((1, "_float_row", itertools.product((512, 1024, 2048), (1, 2, 4))),
                             (tb.MATVEC_ROWS, "_small_gemm", itertools.product((1, 2, 4, 8), (2, 3, 4)))):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        used, times = getattr(mat, attr), {}
        for config in [used] + [c for c in choices if c != used]:
            if time.monotonic() > deadline:
                break
            setattr(mat, attr, config)
            times[config] = _us(lambda x=x: mat.matvec(x))
        setattr(mat, attr, used)
        _report(f"Q8_0 {n}x{k}, {m} rows", times, used, "values a step, warps" if m == 1 else "warps, stages")


def dense_mma(deadline: float, shapes: tuple[tuple[Q, int, int], ...] = DENSE[1:] + DENSE[:1]) -> None:
    """The dense shapes' 2-8 rows on the tensor cores (`Matrix._mma`: weight rows a program, warps, stages, parts
    of k), beside the code without them (`_mma` None: the int16 kernel, Q8_0's GEMM); each time includes x's
    rounding and int8 planes, as a window's does. The head's long compiles last."""
    gen = torch.Generator().manual_seed(3)
    for i, (qtype, n, k) in enumerate(shapes):
        shape_deadline = time.monotonic() + (deadline - time.monotonic()) / (len(shapes) - i)
        mat = tb.Matrix(qtype, tb.random_blocks(qtype, n, k, gen).cuda(), k)
        x = torch.randn(tb.MATVEC_ROWS, k, device="cuda", dtype=torch.bfloat16)
        used, times = mat._mma, {}
        parts = [p for p in (1, 2, 4, 8) if (k // 256) % p == 0 and (n < 32768 or p == 1)]
        choices = [tb.MmaTiles(r, w, s, p) for (r, w), s, p in itertools.product(
            ((16, 1), (32, 1), (32, 2), (64, 2)), (2, 3), parts)]
        for config in [used, None] + [c for c in choices if c != used]:
            if config not in (used, None) and time.monotonic() > shape_deadline:
                break
            mat._mma = config
            times[dataclasses.astuple(config) if config else (WITHOUT,)] = _us(lambda mat=mat, x=x: mat.matvec(x))
        _report(f"{qtype.name} {n}x{k}, {tb.MATVEC_ROWS} rows", times, dataclasses.astuple(used) if used else
                (WITHOUT,), "rows a program, warps, stages, parts of k")


def dense_copies(deadline: float, shapes: tuple[tuple[Q, int, int], ...] = DENSE[1:] + DENSE[:1] + Q8_0_DENSE[3:]) -> None:
    """Each dense shape's products of 1, 2, 4 and 8 rows: the blocks' kernels (`Matrix.matvec`, as a window without
    a copy runs them) against torch's on the matrix dequantized to bf16 (as `GpuBlockLinear` with a dense copy)."""
    gen = torch.Generator().manual_seed(4)
    for qtype, n, k in shapes:
        if time.monotonic() > deadline:
            break
        mat = tb.Matrix(qtype, tb.random_blocks(qtype, n, k, gen).cuda(), k)
        copy = mat.dequantize(dtype=torch.bfloat16)
        print(f"{qtype.name} {n}x{k}: blocks {mat.blocks.numel() / 2**20:.1f} MiB, bf16 copy "
              f"{copy.numel() * 2 / 2**20:.1f} MiB  (us: blocks / copy)")
        for m in (1, 2, 4, tb.MATVEC_ROWS):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            on_blocks = _us(lambda mat=mat, x=x: mat.matvec(x))
            on_copy = _us(lambda copy=copy, x=x: torch.mm(x, copy.t()))
            print(f"  {m} rows  {on_blocks:8.1f} / {on_copy:8.1f}  ({on_blocks / on_copy:.2f}x)")
        del mat, copy


def unpacked_head(deadline: float) -> None:
    """The Q6_K head's 2-8 rows unpacked (`triton_unpacked`: `UNPACKED_TILES`, the default marked) beside its blocks'
    kernel and torch's product on a bf16 copy (what `engine.dense_copies` keeps), then on tiles dequantized from its
    blocks (`triton_tiles`, `HEAD_TILES`)."""
    qtype, n, k = DENSE[0]  # the Q6_K head
    mat = tb.Matrix(qtype, tb.random_blocks(qtype, n, k, torch.Generator().manual_seed(5)).cuda(), k)
    copy, unpacked = mat.dequantize(dtype=torch.bfloat16), Unpacked(mat.blocks, k)
    default = dataclasses.astuple(unpacked.tiles)
    x = torch.randn(tb.MATVEC_ROWS, k, device="cuda", dtype=torch.bfloat16)
    print(f"{qtype.name} {n}x{k}, 8 rows: blocks {_us(lambda: mat.matvec(x)):.1f} us ({mat.blocks.numel() / 2**20:.0f} MiB), "
          f"bf16 copy {_us(lambda: torch.mm(x, copy.t())):.1f} ({copy.numel() * 2 / 2**20:.0f} MiB), unpacked "
          f"{unpacked.nbytes / 2**20:.0f} MiB:")
    times = {}
    for config in (default,) + tuple(c for c in UNPACKED_TILES if c != default):
        if config != default and time.monotonic() > deadline:
            break
        unpacked.tiles = UnpackedTiles(*config)
        times[config] = _us(lambda: unpacked.matvec(x))
    _report("  unpacked", times, default, "weight rows a program, values a step, warps, stages")
    on_blocks = {}
    for config in HEAD_TILES:
        if time.monotonic() > deadline:
            break
        tiles = BlockTiles(qtype, mat.blocks, k, TileLaunch(*config))
        on_blocks[config] = _us(lambda tiles=tiles: tiles.matvec(x))
    _report("  tiles on the blocks (`triton_tiles`)", on_blocks, (), "weight rows a program, warps, stages, parts")


def dense_tiles(deadline: float) -> None:
    """The layers' dense shapes' 8 rows (Q4_K, and the mix's Q6_K attn_v) on tiles dequantized from the blocks
    (`triton_tiles`, `DENSE_TILES`, the default marked) beside the blocks' kernels and torch's product on a bf16 copy:
    each figure a call over `LAYERS` matrices of the shape, as a window reads them (from HBM, not the L2), divided by
    `LAYERS`."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(tb.MATVEC_ROWS, 4096, device="cuda", dtype=torch.bfloat16)
    for qtype, n, k in DENSE[1:]:
        mats = [tb.Matrix(qtype, tb.random_blocks(qtype, n, k, gen).cuda(), k) for _ in range(LAYERS)]
        copies = [mat.dequantize(dtype=torch.bfloat16) for mat in mats]
        xk = x[:, :k].contiguous()
        each = {"blocks": _us(lambda mats=mats, xk=xk: [mat.matvec(xk) for mat in mats]) / LAYERS,
                "bf16 copy": _us(lambda copies=copies, xk=xk: [torch.mm(xk, c.t()) for c in copies]) / LAYERS}
        print(f"{qtype.name} {n}x{k}, 8 rows, a call over {LAYERS}: " + ", ".join(f"{name} {us:.1f} us"
                                                                               for name, us in each.items()))
        del copies
        default = dataclasses.astuple(TileLaunch())
        times = {}
        for config in (default,) + tuple(c for c in DENSE_TILES if c != default):
            if config != default and time.monotonic() > deadline:
                break
            tiles = [BlockTiles(qtype, mat.blocks, k, TileLaunch(*config)) for mat in mats]
            times[config] = _us(lambda tiles=tiles, xk=xk: [t.matvec(xk) for t in tiles]) / LAYERS
        _report("  tiles", times, default, "weight rows a program, warps, stages, parts of k")


def tile_runs_window(deadline: float, copies: bool = False, types: tuple[Q, Q] = (Q.Q4_K, Q.Q6_K)) -> None:
    """The fused MoE kernel's runs of 2-8 pairs on tiles of x's dtype dequantized in registers (`Tiles.tile_runs`,
    and its pairs alone too: `Tiles.tile_alone`; `TILE_RUNS`) beside the code's tiles, in a window of 8 rows
    (`moe_window`'s routings: skewed, or `copies`)."""
    stack, x, h, routing, slot_of = _window_case(tb.MATVEC_ROWS, copies, types)
    g0, d0 = tm.Tiles.for_stack(types[0], HIDDEN, True), tm.Tiles.for_stack(types[1], FF, False)
    gated = {("code",): _us(lambda: tm.swiglu(stack("gate", g0), stack("up", g0), x, routing, slot_of))}
    down = {("code",): _us(lambda: tm.project(stack("down", d0), h, routing, slot_of))}
    for mma, warps, parts, alone in TILE_RUNS:
        if time.monotonic() > deadline:
            break
        g = dataclasses.replace(g0, mma_rows=mma, matvec_warps=warps, tile_runs=True, run_parts=parts, tile_alone=alone)
        d = dataclasses.replace(d0, mma_rows=mma, matvec_warps=warps, tile_runs=True, tile_alone=alone,
                                run_parts=1 if parts == 1 else FF // tb.MMA_STEP)
        key = ("tiles", mma, warps) + (("alone",) if alone else ())
        gated[key + (parts,)] = _us(lambda g=g: tm.swiglu(stack("gate", g), stack("up", g), x, routing, slot_of))
        down[key + (d.run_parts,)] = _us(lambda d=d: tm.project(stack("down", d), h, routing, slot_of))
    experts = routing.experts.unique().numel()
    legend = "tiles: mma_rows, warps, (pairs alone on them too,) parts of k"
    _report(f"MoE gate+up ({types[0].name}), 8 rows, {experts} experts", gated, ("code",), legend)
    _report(f"MoE down ({types[1].name}), 8 rows, {experts} experts", down, ("code",), legend)


def _skewed_ids(rows: int, gen: torch.Generator) -> torch.Tensor:
    """[rows, TOP_K] distinct experts a row, drawn with weights rank ** -0.5: eight rows route ~50 distinct
    experts, as the 12-layer test models with `--router-skew 1` do."""
    weights = (torch.arange(1, EXPERTS + 1, dtype=torch.float64) ** -0.5)[torch.randperm(EXPERTS, generator=gen)]
    return torch.stack([torch.multinomial(weights, TOP_K, generator=gen) for _ in range(rows)])


def _window_case(rows: int, copies: bool, types: tuple[Q, Q]) -> tuple[Callable[[str, tm.Tiles], tm.Stack], ...]:
    """Random gate, up and down stacks (gates and ups of `types[0]`, downs of `types[1]`) as `stack(name, tiles)`
    makes them, x and h of a window of `rows` rows, its routing (`moe_window`'s `copies`) and the slot table."""
    gen = torch.Generator().manual_seed(1)
    gate_type, down_type = types
    shapes = {"gate": (gate_type, FF, HIDDEN), "up": (gate_type, FF, HIDDEN), "down": (down_type, HIDDEN, FF)}
    blocks = {name: (qtype, tb.random_blocks(qtype, EXPERTS * n, k, gen).view(EXPERTS, n, -1).cuda(), k)
              for name, (qtype, n, k) in shapes.items()}
    slot_of = torch.arange(EXPERTS, dtype=torch.int32, device="cuda")
    ids = (_skewed_ids(1, gen).repeat(rows, 1) if copies else _skewed_ids(rows, gen)).cuda()
    x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(rows * TOP_K, FF, device="cuda", dtype=torch.bfloat16)

    def stack(name: str, tiles: tm.Tiles) -> tm.Stack:
        qtype, b, k = blocks[name]
        return tm.Stack(qtype, b, k, tiles)

    return stack, x, h, tm.Routing.of(ids, EXPERTS), slot_of


def float_window(deadline: float, copies: bool = False, qtype: Q = Q.F16) -> None:
    """F16 or BF16 experts on a window of 8 rows (`moe_window`'s routings): the tensor cores' tf32 tiles
    (`FLOAT_TILES`: `Tiles.mma_rows`, `Tiles.mma_k`, `Tiles.matvec_warps`) beside the float sums (mma_rows 0, their
    one-warp programs), then the code's tiles walking the window's runs (`WALKS`)."""
    stack, x, h, routing, slot_of = _window_case(tb.MATVEC_ROWS, copies, (qtype, qtype))
    gated, down = {}, {}
    code = {g: tm.Tiles.for_stack(qtype, k, g) for g, k in ((True, HIDDEN), (False, FF))}

    def key(t: tm.Tiles) -> tuple[int | str, ...]:
        return (t.mma_rows, t.mma_k, t.matvec_warps) if t.mma_rows else (WITHOUT,)

    for config in [None] + list(FLOAT_TILES):
        if config and time.monotonic() > deadline:
            break
        for g, times in ((True, gated), (False, down)):
            t = code[g]
            t = dataclasses.replace(t, mma_rows=0, matvec_warps=1) if config is None else dataclasses.replace(
                t, mma_rows=config[0], mma_k=config[1], matvec_warps=config[2])
            if key(t) in times:
                continue
            if g:
                times[key(t)] = _us(lambda t=t: tm.swiglu(stack("gate", t), stack("up", t), x, routing, slot_of))
            else:
                times[key(t)] = _us(lambda t=t: tm.project(stack("down", t), h, routing, slot_of))
    for walk in WALKS:  # programs walking the window's runs (`Tiles.pairs_a_program`), the code's tiles
        if time.monotonic() > deadline:
            break
        g, d = (dataclasses.replace(code[gate], pairs_a_program=walk) for gate in (True, False))
        gated[("walk", walk)] = _us(lambda g=g: tm.swiglu(stack("gate", g), stack("up", g), x, routing, slot_of))
        down[("walk", walk)] = _us(lambda d=d: tm.project(stack("down", d), h, routing, slot_of))
    experts = routing.experts.unique().numel()
    legend = "weight rows a program, values a step, warps"
    _report(f"MoE gate+up ({qtype.name}), 8 rows, {experts} experts", gated, key(code[True]), legend)
    _report(f"MoE down ({qtype.name}), 8 rows, {experts} experts", down, key(code[False]), legend)


def moe_window(rows: int, deadline: float, copies: bool = False, types: tuple[Q, Q] = (Q.Q4_K, Q.Q6_K),
               runs_only: bool = False) -> None:
    """The fused MoE kernel on a window of `rows` rows, gates and ups of `types[0]`, downs of `types[1]` (the
    Q4_K_M mix's by default): one row sweeps `Tiles.solo_*`, more rows the matvec tiles (`matvec_rows`,
    `row_blocks`, `matvec_warps`), which also serve their pairs alone on an expert, and for the gates and ups
    each configuration with `Tiles.joint` ("joint" in the key, where the type joins) and without.
    `copies`: every row routes the first row's experts, as `bench-engine`'s 8 rows (copies of one session)
    do: runs of `rows` pairs on 8 experts instead of ~50 experts in runs of 1-3. Then runs on the tensor cores
    (`MMA_RUNS`: `Tiles.mma_rows`, warps, `Tiles.run_parts`) and, for Q4_K and Q6_K, on the int16 sums in parts of
    k (`INT16_PARTS`, the down's k of 768 in 3), windows on int8 x (`Tiles.int8_windows`, `INT8_TILES`) and
    programs walking pairs (`WALKS`, `Tiles.pairs_a_program`); `runs_only`: those beside the code's tiles alone."""
    gate_type, down_type = types
    stack, x, h, routing, slot_of = _window_case(rows, copies, types)

    def tiles_of(qtype: Q, k: int, gated: bool, config: tuple[int, int, int]) -> tm.Tiles:
        used, (r, b, w) = tm.Tiles.for_stack(qtype, k, gated), config
        if rows == 1:
            return dataclasses.replace(used, solo_rows=r, solo_blocks=b, solo_warps=w)
        return dataclasses.replace(used, matvec_rows=r, row_blocks=b, matvec_warps=w)

    def int8_tiles_of(qtype: Q, k: int, gated: bool, config: tuple[int, int, int]) -> tm.Tiles:
        if qtype == Q.Q8_0:  # its int8 sums take `matvec_k` values a step
            r, values, w = config
            tiles = dataclasses.replace(tm.Tiles.for_stack(qtype, k, gated), matvec_rows=r, matvec_k=values,
                                        matvec_warps=w)
        else:
            tiles = tiles_of(qtype, k, gated, config)
        return dataclasses.replace(tiles, int8_windows=True)

    def chosen(qtype: Q, k: int, gated: bool) -> tuple[int, int, int]:
        t = tm.Tiles.for_stack(qtype, k, gated)
        return (t.solo_rows, t.solo_blocks, t.solo_warps) if rows == 1 else (t.matvec_rows, t.row_blocks, t.matvec_warps)

    gated, down = {}, {}
    joins = tm.Tiles.for_stack(gate_type, HIDDEN, True).joins(gate_type, gate_type)
    code = [chosen(gate_type, HIDDEN, True), chosen(down_type, FF, False)]
    configs = code + ([] if runs_only else [c for c in _configs(CHOICES, CHOICES, CHOICES[:3]) if c not in code])
    for config in configs:
        if time.monotonic() > deadline:
            break
        if not runs_only or config == code[0]:
            g = dataclasses.replace(tiles_of(gate_type, HIDDEN, True, config), joint=False)
            gated[config] = _us(lambda g=g: tm.swiglu(stack("gate", g), stack("up", g), x, routing, slot_of))
            if joins:
                g = dataclasses.replace(g, joint=True)
                gated[config + ("joint",)] = _us(lambda g=g: tm.swiglu(stack("gate", g), stack("up", g), x, routing,
                                                                        slot_of))
        if not runs_only or config == code[1]:
            d = tiles_of(down_type, FF, False, config)
            down[config] = _us(lambda d=d: tm.project(stack("down", d), h, routing, slot_of))
    # windows on int8 x (`Tiles.int8_windows`): weight rows a program, blocks a step (Q8_0: values a step), warps
    int8_tiles = INT8_Q8_0_TILES if gate_type == Q.Q8_0 else INT8_TILES
    for config in int8_tiles if rows > 1 and {gate_type, down_type} <= tm.INT8_TYPES else ():
        if time.monotonic() > deadline:
            break
        g, d = (int8_tiles_of(gate_type, HIDDEN, True, config), int8_tiles_of(down_type, FF, False, config))
        gated[("int8",) + config] = _us(lambda g=g: tm.swiglu(stack("gate", g), stack("up", g), x, routing, slot_of))
        down[("int8",) + config] = _us(lambda d=d: tm.project(stack("down", d), h, routing, slot_of))
    # runs on the tensor cores: weight rows a program, warps, parts of k (the down's k = 768 in 1 or 3)
    for mma, warps, parts in MMA_RUNS if rows > 1 else ():
        if time.monotonic() > deadline:
            break
        g = dataclasses.replace(tm.Tiles.for_stack(gate_type, HIDDEN, True), matvec_warps=warps, mma_rows=mma,
                                run_parts=parts)
        d = dataclasses.replace(tm.Tiles.for_stack(down_type, FF, False), matvec_warps=warps, mma_rows=mma,
                                run_parts=1 if parts == 1 else FF // tb.MMA_STEP)
        gated[("mma", mma, warps, parts)] = _us(lambda g=g: tm.swiglu(stack("gate", g), stack("up", g), x, routing,
                                                                       slot_of))
        down[("mma", mma, warps, d.run_parts)] = _us(lambda d=d: tm.project(stack("down", d), h, routing, slot_of))
    # runs on the int16 sums with k in parts: the code's tiles otherwise
    for parts in INT16_PARTS if rows > 1 and {gate_type, down_type} <= set(tb.ROUNDED) else ():
        if time.monotonic() > deadline:
            break
        g = dataclasses.replace(tm.Tiles.for_stack(gate_type, HIDDEN, True), run_parts=parts)
        gated[("int16", g.matvec_warps, parts)] = _us(lambda g=g: tm.swiglu(stack("gate", g), stack("up", g), x,
                                                                             routing, slot_of))
        d = dataclasses.replace(tm.Tiles.for_stack(down_type, FF, False), run_parts=FF // 256)
        if ("int16", d.matvec_warps, d.run_parts) not in down:
            down[("int16", d.matvec_warps, d.run_parts)] = _us(lambda d=d: tm.project(stack("down", d), h, routing,
                                                                                       slot_of))
    # programs walking sorted pairs (`Tiles.pairs_a_program`): the code's tiles otherwise
    for walk in WALKS if rows > 1 else ():
        if time.monotonic() > deadline:
            break
        g = dataclasses.replace(tm.Tiles.for_stack(gate_type, HIDDEN, True), pairs_a_program=walk)
        d = dataclasses.replace(tm.Tiles.for_stack(down_type, FF, False), pairs_a_program=walk)
        gated[("walk", walk)] = _us(lambda g=g: tm.swiglu(stack("gate", g), stack("up", g), x, routing, slot_of))
        down[("walk", walk)] = _us(lambda d=d: tm.project(stack("down", d), h, routing, slot_of))
    experts = routing.experts.unique().numel()
    used = chosen(gate_type, HIDDEN, True) + (("joint",) if joins else ())
    _report(f"MoE gate+up ({gate_type.name}), {rows} rows, {experts} experts", gated, used)
    _report(f"MoE down ({down_type.name}), {rows} rows, {experts} experts", down, chosen(down_type, FF, False))


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    seconds = float(args[0]) if args else 300.0
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, {seconds:.0f} s")
    start = time.monotonic()
    if "--float" in sys.argv:  # F16 experts' windows on the tensor cores, both routings
        for i, copies in enumerate((False, True), 1):
            float_window(start + seconds * i / 2, copies)
        return
    if "--copies" in sys.argv:
        dense_copies(start + seconds * 0.4)
        dense_tiles(start + seconds * 0.8)
        unpacked_head(start + seconds)
        return
    if "--tiles" in sys.argv:  # every form on tiles: the dense shapes, the head, the MoE's runs
        dense_tiles(start + seconds * 0.25)
        unpacked_head(start + seconds * 0.4)
        tile_runs_window(start + seconds * 0.7)
        tile_runs_window(start + seconds * 0.85, copies=True)
        tile_runs_window(start + seconds, types=(Q.Q4_K, Q.Q4_K))
        return
    if "--tile-runs" in sys.argv:  # the MoE's runs on tiles: skewed, copies, the mix's Q4_K down
        tile_runs_window(start + seconds * 0.45)
        tile_runs_window(start + seconds * 0.75, copies=True)
        tile_runs_window(start + seconds, types=(Q.Q4_K, Q.Q4_K))
        return
    if "--runs" in sys.argv:  # the MoE's runs on the tensor cores only, both mixes, both routings
        cases = [(types, copies) for types in ((Q.Q4_K, Q.Q6_K), (Q.Q8_0, Q.Q8_0)) for copies in (False, True)]
        for i, (types, copies) in enumerate(cases, 1):
            moe_window(tb.MATVEC_ROWS, start + seconds * i / len(cases), copies, types, runs_only=True)
        return
    moe_window(tb.MATVEC_ROWS, start + seconds * 0.2)
    moe_window(tb.MATVEC_ROWS, start + seconds * 0.35, copies=True)
    moe_window(tb.MATVEC_ROWS, start + seconds * 0.4, types=(Q.Q4_K, Q.Q4_K))  # the mix's other down
    dense(tb.MATVEC_ROWS, start + seconds * 0.6)
    dense(1, start + seconds * 0.75)
    q8_head(start + seconds * 0.8)
    dense_mma(start + seconds * 0.9)
    moe_window(1, start + seconds)


if __name__ == "__main__":
    main()
