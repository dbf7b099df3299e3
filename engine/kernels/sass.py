"""`python -m engine.kernels.sass`: the decode and prompt kernels compiled for an H200 (sm_90) without a GPU,
with the tiles the code chooses at qwen3-30b-a3b's shapes: each kernel's registers a thread (65,536 a
multiprocessor: what caps its warps), stack bytes (spills), SASS instructions and the commonest of them.

Triton compiles from the source as a launch would (`triton.compile` for a `GPUTarget`), then its own
CUDA tools (the NVIDIA backend's `bin/`: `cuobjdump -res-usage`, `nvdisasm`) read the cubin. The launch's
specialization is given as the engine's tensors and sizes have it: pointers 16-byte aligned, integers
divisible by 16 where theirs are, none for the arguments a kernel does not specialize. Without it the loads
are laid out differently and the counts mislead. The counts come from this machine's Triton, which may
differ from the GPU host's; they guide, and a GPU's timing decides (`engine.kernels.sweep`)."""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import triton
import triton.backends.nvidia as nvidia
from gguf import GGMLQuantizationType as Q
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from engine.kernels import gpu
from engine.kernels import triton_blocks as tb
from engine.kernels import triton_moe as tm

HIDDEN, FF, HEAD, TOP_K = 2048, 768, 151936, 8  # qwen3-30b-a3b: hidden size, an expert's FFN, the vocabulary


@dataclass(frozen=True)
class Usage:
    registers: int  # a thread's
    stack: int  # bytes a thread (spills)
    instructions: int
    ops: collections.Counter
    warps: int  # a program's

    @property
    def warps_an_sm(self) -> int:
        """The most warps of these programs an sm_90 multiprocessor holds: each of its 4 schedulers has 16,384
        registers, given a warp in steps of 256; at most 64 warps and 32 programs (as Nsight Compute's
        theoretical occupancy counts them)."""
        per_warp = -(-self.registers * 32 // 256) * 256
        by_registers = 4 * (16384 // per_warp) // self.warps * self.warps
        return min(by_registers, 64 // self.warps * self.warps, 32 * self.warps)

    def line(self, name: str, top: int = 8) -> str:
        common = ", ".join(f"{op} {n}" for op, n in self.ops.most_common(top))
        return (f"{name:40} {self.registers:3} registers ({self.warps_an_sm:2} warps an SM), stack {self.stack}, "
                f"{self.instructions:4} instructions: {common}")


def _tool(name: str) -> str:
    path = os.path.join(os.path.dirname(nvidia.__file__), "bin", name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing: this Triton has no CUDA tools bundled")
    return path


def usage(kernel: triton.runtime.jit.JITFunction, args: dict[str, str | int], constexprs: dict[str, int | bool],
          warps: int, arch: int = 90) -> Usage:
    """Compile `kernel` for sm_`arch`: `args` gives each runtime argument as a pointer type ('*u8', '*bf16', ...)
    or as the integer a launch passes (its divisibility by 16 specializes it, as at a launch)."""
    if not isinstance(kernel, triton.runtime.jit.JITFunction):
        raise RuntimeError("the kernels are Triton's interpreter's (TRITON_INTERPRET=1): run without it")
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        value = args[name]
        signature[name] = value if isinstance(value, str) else "i32" if abs(value) < 2**31 else "i64"
        if name not in kernel.do_not_specialize and (isinstance(value, str) or value % 16 == 0):
            attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": warps, "enable_fp_fusion": True})
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        resources = subprocess.run([_tool("cuobjdump"), "-res-usage", cubin], capture_output=True, text=True,
                                   check=True).stdout
        sass = subprocess.run([_tool("nvdisasm"), cubin], capture_output=True, text=True, check=True).stdout
    ops = collections.Counter(m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)",
                                                               sass))
    return Usage(int(re.search(r"REG:(\d+)", resources).group(1)), int(re.search(r"STACK:(\d+)", resources).group(1)),
                 sum(ops.values()), ops, warps)


_MOE_ARGS = dict(w="*u8", w2="*u8", wf="*u8", wf2="*u8", slot_of="*i32", experts="*i32", src="*i32", dst="*i64",
                 x="*bf16", xq="*i16", xs="*fp32", xsum="*fp32", xh="*i32", y="*bf16", parts="*fp32",
                 tile_expert="*i32", padded="*i32", pairs=64)
_DENSE_ARGS = dict(w="*u8", xq="*i16", xs="*fp32", xsum="*fp32", halves="*i32", y="*bf16", m=8)


def _moe(qtype: Q, gated: bool) -> tuple[tm.Tiles, dict[str, str | int], dict[str, int | bool]]:
    """A projection's tiles, the MoE kernels' runtime arguments and its type's compile-time ones."""
    n, k = (FF, HIDDEN) if gated else (HIDDEN, FF)
    row_bytes = tb.row_bytes(qtype, k)
    sizes = dict(n=n, k=k, row_bytes=row_bytes, expert_bytes=n * row_bytes, row_bytes2=row_bytes,
                 expert_bytes2=n * row_bytes)
    tiles = tm.Tiles.for_stack(qtype, k, gated)
    return tiles, _MOE_ARGS | sizes, tm.type_args(qtype) | tm.type_args(qtype, "2") | dict(
        GATED=gated, JOINT=gated and tiles.joins(qtype, qtype), PDL=False)


def moe_matvec(qtype: Q, gated: bool, one_row: bool, mma_rows: int | None = None, parts: int = 1,
               int8: bool = False) -> Usage:
    """The fused MoE matvec for a projection of `qtype` (gate+up when `gated`), with its tiles for windows of 2-8
    rows (runs on the tensor cores in programs of `mma_rows` weight rows, k in `parts`, when given; x rounded to
    int8 where `int8`), or of one row: qwen3-30b-a3b's top 8 of its experts."""
    t, args, consts = _moe(qtype, gated)
    if int8:
        args = args | dict(xq="*i8")
    rows, warps, blocks = (t.solo_rows, t.solo_warps, t.solo_blocks) if one_row else \
        (t.matvec_rows, t.matvec_warps, t.row_blocks)
    mma = 0 if one_row else dataclasses.replace(t, mma_rows=t.mma_rows if mma_rows is None else mma_rows).mma_program(rows)
    rows, step, alone = tm.matvec_program(t, qtype in gpu.FLOAT_BLOCKS, rows, mma)
    _, walking = tm.walk_program(t, one_row, TOP_K)
    return usage(tm._moe_matvec_kernel, args, consts | dict(R=rows, BK=step, ROWS=tb.MATVEC_ROWS, SB=blocks,
                                                            SB2=blocks, ASM=True, MMA=mma, ALONE=alone, PARTS=parts,
                                                            TILE_RUNS=False, **walking), warps)


def moe_gemm(qtype: Q, gated: bool) -> Usage:
    """The fused MoE GEMM of prompt chunks for a projection of `qtype`, with its tiles."""
    t, args, consts = _moe(qtype, gated)
    consts = {key: v for key, v in consts.items() if not key.startswith("HAS")}
    return usage(tm._moe_gemm_kernel, args, consts | dict(BM=t.gemm_m, BN=t.gemm_n, BK=t.gemm_k), t.gemm_warps)


def dense(qtype: Q, n: int, k: int, m: int) -> Usage:
    """`Matrix.matvec`'s int16 kernel (Q4_K, Q6_K) for m rows, with the tiles `Matrix` chooses for n x k."""
    one_row, rows_of_8 = tb.int16_tiles(qtype, n, k, tb.Tiles.for_shape(n, k))
    rows, blocks, warps = one_row if m == 1 else rows_of_8
    return usage(tb._rounded_kernel, _DENSE_ARGS | dict(m=m, n=n, k=k, row_bytes=tb.row_bytes(qtype, k)),
                 dict(QTYPE=int(qtype), R=rows, SB=blocks, ROWS=1 if m == 1 else tb.MATVEC_ROWS, ASM=True, PDL=False),
                 warps)


def dense_mma(qtype: Q, n: int, k: int) -> Usage:
    """`Matrix.matvec`'s 2-8 rows on the tensor cores, with the tiles `mma_tiles` names for n x k."""
    tiles = tb.mma_tiles(qtype, n, k)
    out = "*fp32" if tiles.parts > 1 else "*bf16"  # parts go to a float32 buffer, `_add_parts` adds them
    per = tb.steps_per_part(qtype, k, tiles.parts)
    return usage(tb._mma_kernel, dict(w="*u8", x_hi="*i8", x_lo="*i8", xs="*fp32", xsum="*fp32", out=out, m=8, n=n,
                                      k=k, row_bytes=tb.row_bytes(qtype, k), per=per),
                 dict(QTYPE=int(qtype), R=tiles.rows, ASM=True, PDL=False), tiles.warps)


def main() -> None:
    print(f"sm_90, triton {triton.__version__}, qwen3-30b-a3b's shapes, the code's tiles")
    for name, fn in (("MoE gate+up Q4_K, windows of 2-8 rows", lambda: moe_matvec(Q.Q4_K, True, False)),
                     ("MoE down Q6_K, windows of 2-8 rows", lambda: moe_matvec(Q.Q6_K, False, False)),
                     ("MoE gate+up Q4_K, windows of 2-8 rows on int8 x",
                      lambda: moe_matvec(Q.Q4_K, True, False, int8=True)),
                     ("MoE down Q6_K, windows of 2-8 rows on int8 x", lambda: moe_matvec(Q.Q6_K, False, False, int8=True)),
                     ("MoE gate+up Q4_K, runs on the tensor cores", lambda: moe_matvec(Q.Q4_K, True, False, 16)),
                     ("MoE down Q6_K, runs on the tensor cores", lambda: moe_matvec(Q.Q6_K, False, False, 16)),
                     ("MoE gate+up Q4_K, runs on the tensor cores, k in 4 parts",
                      lambda: moe_matvec(Q.Q4_K, True, False, 16, 4)),
                     ("MoE gate+up Q8_0, windows of 2-8 rows", lambda: moe_matvec(Q.Q8_0, True, False)),
                     ("MoE gate+up Q8_0, windows of 2-8 rows on int8 x",
                      lambda: moe_matvec(Q.Q8_0, True, False, int8=True)),
                     ("MoE down Q8_0, windows of 2-8 rows on int8 x", lambda: moe_matvec(Q.Q8_0, False, False, int8=True)),
                     ("MoE gate+up Q8_0, runs on the tensor cores", lambda: moe_matvec(Q.Q8_0, True, False, 16)),
                     ("MoE down Q8_0, runs on the tensor cores", lambda: moe_matvec(Q.Q8_0, False, False, 16)),
                     ("MoE gate+up F16, windows of 2-8 rows (tensor cores)", lambda: moe_matvec(Q.F16, True, False)),
                     ("MoE down F16, windows of 2-8 rows (tensor cores)", lambda: moe_matvec(Q.F16, False, False)),
                     ("MoE gate+up F16, windows of 2-8 rows (float sums)", lambda: moe_matvec(Q.F16, True, False, 0)),
                     ("MoE gate+up Q4_K, one row", lambda: moe_matvec(Q.Q4_K, True, True)),
                     ("MoE down Q6_K, one row", lambda: moe_matvec(Q.Q6_K, False, True)),
                     ("MoE GEMM gate+up Q4_K (prompt)", lambda: moe_gemm(Q.Q4_K, True)),
                     ("MoE GEMM gate+up Q8_0 (prompt)", lambda: moe_gemm(Q.Q8_0, True)),
                     ("Q4_K 5120x2048, 8 rows (int16 kernel)", lambda: dense(Q.Q4_K, 5120, HIDDEN, 8)),
                     ("Q6_K head, 8 rows (int16 kernel)", lambda: dense(Q.Q6_K, HEAD, HIDDEN, 8)),
                     ("Q4_K 5120x2048, 8 rows (tensor cores)", lambda: dense_mma(Q.Q4_K, 5120, HIDDEN)),
                     ("Q8_0 2048x4096, 8 rows (tensor cores)", lambda: dense_mma(Q.Q8_0, HIDDEN, 4096)),
                     ("Q6_K head, 8 rows (tensor cores)", lambda: dense_mma(Q.Q6_K, HEAD, HIDDEN)),
                     ("Q6_K head, one row", lambda: dense(Q.Q6_K, HEAD, HIDDEN, 1))):
        print(fn().line(name), flush=True)


if __name__ == "__main__":
    main()
