"""`python -m engine.kernels.sweep [SECONDS]`: the one-row tile sweeps behind `triton_blocks` and
`triton_moe.Tiles.solo_*` on a CUDA device, within a time limit (each configuration compiles once,
1-3 s): the int16 dense kernel (`_rounded_kernel`: weight rows a program, blocks a step, warps) at
qwen3-30b-a3b's dense shapes and its Q6_K head, then the fused MoE kernel's one-row windows (gate+up,
down). Each figure is one call replayed from a CUDA graph (`triton.testing.do_bench_cudagraph`);
each shape's configurations are printed fastest first, the one the code uses marked."""

from __future__ import annotations

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
from engine.kernels.triton_xq import ASM, RoundedRows

DENSE = ((Q.Q4_K, 5120, 2048), (Q.Q4_K, 2048, 4096), (Q.Q6_K, 512, 2048), (Q.Q6_K, 151936, 2048))
HIDDEN, FF, EXPERTS, TOP_K = 2048, 768, 128, 8
CHOICES = (1, 2, 4, 8)


def _us(fn: Callable[[], object]) -> float:
    fn()
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=30) * 1e3


def _report(name: str, times: dict[tuple[int, int, int], float], used: tuple[int, int, int]) -> None:
    print(f"{name}  (rows a program, blocks a step, warps; * = the code's choice)")
    for config, us in sorted(times.items(), key=lambda item: item[1]):
        print(f"  {'*' if config == used else ' '} {config}  {us:8.1f} us")


def _dense(qtype: Q, n: int, k: int, deadline: float, gen: torch.Generator) -> None:
    mat = tb.Matrix(qtype, tb.random_blocks(qtype, n, k, gen).cuda(), k)
    rounded = RoundedRows.of(torch.randn(1, k, device="cuda", dtype=torch.bfloat16))
    y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)

    def call(rows: int, blocks: int, warps: int) -> None:
        tb._rounded_kernel[(triton.cdiv(n, rows),)](
            mat.blocks, rounded.q, rounded.scale, rounded.sums, rounded.halves, y, 1, n, k, mat.blocks.shape[1],
            QTYPE=int(qtype), R=rows, SB=blocks, ROWS=1, ASM=ASM, num_warps=warps)

    times = {}
    for config in itertools.product(CHOICES[:3], CHOICES, CHOICES[:3]):
        if time.monotonic() > deadline:
            break
        times[config] = _us(lambda config=config: call(*config))
    _report(f"{qtype.name} {n}x{k}, one row", times, (2, mat._int_blocks, mat._int_warps))


def dense_one_row(deadline: float) -> None:
    gen = torch.Generator().manual_seed(0)
    for qtype, n, k in DENSE:
        _dense(qtype, n, k, deadline, gen)


def moe_one_row(deadline: float) -> None:
    gen = torch.Generator().manual_seed(1)
    shapes = {"gate": (Q.Q4_K, FF, HIDDEN), "up": (Q.Q4_K, FF, HIDDEN), "down": (Q.Q6_K, HIDDEN, FF)}
    blocks = {name: (qtype, tb.random_blocks(qtype, EXPERTS * n, k, gen).view(EXPERTS, n, -1).cuda(), k)
              for name, (qtype, n, k) in shapes.items()}
    slot_of = torch.arange(EXPERTS, dtype=torch.int32, device="cuda")
    ids = torch.randperm(EXPERTS, generator=gen)[:TOP_K][None].cuda()
    routing = tm.Routing.of(ids, EXPERTS)
    x = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(TOP_K, FF, device="cuda", dtype=torch.bfloat16)

    def stack(name: str, tiles: tm.Tiles) -> tm.Stack:
        qtype, b, k = blocks[name]
        return tm.Stack(qtype, b, k, tiles)

    gated, down = {}, {}
    for rows, blocks_a_step, warps in itertools.product(CHOICES, CHOICES, CHOICES):
        if time.monotonic() > deadline:
            break
        tiles = tm.Tiles(8, 512, 64, 64, 64, solo_rows=rows, solo_warps=warps, solo_blocks=blocks_a_step)
        config = (rows, blocks_a_step, warps)
        gated[config] = _us(lambda t=tiles: tm.swiglu(stack("gate", t), stack("up", t), x, routing, slot_of))
        down[config] = _us(lambda t=tiles: tm.project(stack("down", t), h, routing, slot_of))
    used = tm.Tiles.for_stack(Q.Q4_K, HIDDEN, gated=True)
    _report("MoE gate+up (Q4_K), one row", gated, (used.solo_rows, used.solo_blocks, used.solo_warps))
    used = tm.Tiles.for_stack(Q.Q6_K, FF, gated=False)
    _report("MoE down (Q6_K), one row", down, (used.solo_rows, used.solo_blocks, used.solo_warps))


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 300.0
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, {seconds:.0f} s")
    start = time.monotonic()
    dense_one_row(start + seconds / 2)
    moe_one_row(start + seconds)


if __name__ == "__main__":
    main()
