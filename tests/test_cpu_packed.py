"""Packed Q8_0, Q5_0, Q4_K and Q6_K matrices (engine/kernels/packed_cpu.c: rows interleaved by 16): lookups and
ranges equal to gguf-py's dequantizer bit for bit, products as accurate as the file layout's, rows independent of
the batch and the threads, the AVX2 build equal to the AVX-512 one (Q8_0; the others pack on AVX-512 builds
only), and the store's policy."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_cpu_kernels import random_blocks, reference

from engine.kernels import cpu
from engine.weights import BlockLinear, Projections

pytestmark = pytest.mark.skipif(not cpu.available(), reason="CPU kernels unavailable")

N, K, M = 96, 256, 16  # M > 4: the kernel's passes of 4 x rows


@pytest.fixture(scope="module", params=[Q.Q8_0, Q.Q5_0, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def qtype(request) -> Q:
    if not cpu.packs(request.param, 16):
        pytest.skip(f"{request.param.name} has no packed layout here")
    return request.param


@pytest.fixture(scope="module")
def blocks(qtype) -> torch.Tensor:
    return torch.from_numpy(random_blocks(qtype, N, K, seed=5))


@pytest.fixture(scope="module")
def packed(qtype, blocks) -> cpu.Matrix:
    return cpu.Matrix(qtype, cpu.pack(qtype, blocks, K), K, packed=True)


def bits(t: torch.Tensor) -> np.ndarray:
    return t.numpy().view(np.uint32)


def test_lookups_and_ranges_match_gguf_py_exactly(qtype, blocks, packed):
    ref = reference(qtype, blocks.numpy(), K)
    ids = torch.tensor([0, 95, 17, 17, 40, 15, 16])
    assert np.array_equal(bits(packed.rows(ids)), ref[ids.numpy()].view(np.uint32))
    assert np.array_equal(bits(packed.dequantize()), ref.view(np.uint32))
    assert np.array_equal(bits(packed.dequantize(5, 37)), ref[5:37].view(np.uint32))
    with pytest.raises(IndexError):
        packed.rows(torch.tensor([N]))


@pytest.mark.parametrize("mode, levels", (("float", 0), ("int16", 32767), ("int8", 127)))
def test_products_are_as_accurate_as_the_file_layout(qtype, blocks, packed, mode, levels):
    """Float: float32 accumulation error only; integer modes: x's rounding per 32 values on top."""
    w = torch.from_numpy(reference(qtype, blocks.numpy(), K)).double()
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(6))
    y = packed.matmul(x, activations=mode).double()
    exact = x.double() @ w.T
    bound = 1e-5 * (x.double().abs() @ w.abs().T)
    if levels:
        step = x.double().abs().view(M, -1, 32).amax(-1, keepdim=True).expand(-1, -1, 32).reshape(M, K) / (2 * levels)
        bound += step @ w.abs().T * 1.001
    assert ((y - exact).abs() <= bound).all()
    if levels and qtype in (Q.Q8_0, Q.Q5_0):  # the file layout's x rounding (the K types' is per 256): its sums
        assert torch.allclose(y, cpu.matmul(qtype, blocks, K, x, activations=mode).double(), rtol=1e-5, atol=1e-4)


@pytest.fixture(scope="module")
def wide(qtype) -> cpu.Matrix:
    """133 groups of 16 rows: the kernel's sets of 16, 8 and 4 groups (by x rows), the last one short."""
    return cpu.Matrix(qtype, cpu.pack(qtype, torch.from_numpy(random_blocks(qtype, 133 * 16, K, seed=6)), K), K,
                      packed=True)


@pytest.mark.parametrize("mode", tuple(cpu.ACTIVATIONS))
@pytest.mark.parametrize("matrix", ["packed", "wide"])
def test_rows_do_not_depend_on_the_batch_or_the_threads(qtype, matrix, mode, request):
    packed = request.getfixturevalue(matrix)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(7))
    before = cpu.threads()
    try:
        cpu.set_threads(1)
        alone = torch.cat([packed.matmul(x[i:i + 1], activations=mode) for i in range(M)])
        for n_threads in (1, 2):
            cpu.set_threads(n_threads)
            for m in (1, 2, 3, 4, 5, 8, 13, 16):
                assert np.array_equal(bits(packed.matmul(x[:m], activations=mode)), bits(alone[:m])), (n_threads, m)
    finally:
        cpu.set_threads(before)


@pytest.mark.skipif(not cpu.available() or not cpu.tiles(), reason="no AMX tiles here")
@pytest.mark.parametrize("tiled, k", ((Q.Q8_0, 480), (Q.Q5_0, 480), (Q.Q4_K, 512), (Q.Q6_K, 512)),
                         ids=lambda v: getattr(v, "name", str(v)))
@pytest.mark.parametrize("mode", ("int16", "int8"))
def test_tiles_give_the_int16_kernels_bits(tiled, k, mode):
    """8-12 x rows or more (by type) of a packed matrix run on AMX tiles (x split into hi and lo bytes, row blocks of
    128, tiles of fewer than 16 rows last, an odd count of blocks): each row the bits of the row alone, which the int16
    kernel computes, and a build without tiles gives them too."""
    matrix = cpu.Matrix(tiled, cpu.pack(tiled, torch.from_numpy(random_blocks(tiled, 48, k, seed=9)), k), k, packed=True)
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(10))
    x[5, :32] = 0  # a sub-block of zeros: its scale is 0
    before = cpu.threads()
    try:
        cpu.set_threads(1)
        alone = torch.cat([matrix.matmul(x[i:i + 1], activations=mode) for i in range(300)])
        for n_threads in (1, 2):
            cpu.set_threads(n_threads)
            for m in (8, 11, 16, 17, 129, 300):
                assert np.array_equal(bits(matrix.matmul(x[:m], activations=mode)), bits(alone[:m])), (n_threads, m)
    finally:
        cpu.set_threads(before)
    without = cpu._open(("-mno-amx-tile", "-mno-amx-int8"))  # a build without the tiles: the int16 kernel for all
    assert not without.sd_tiles()
    y = np.empty((300, 48), dtype=np.float32)
    assert without.sd_matmul_packed(int(tiled), matrix.blocks.data_ptr(), 48, k, x.data_ptr(), 300, y.ctypes.data, 2,
                                    cpu.activation_code(mode)) == 0
    assert np.array_equal(y.view(np.uint32), bits(alone))


def cpu_flags() -> list[str]:
    return Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []


def avx512() -> bool:
    return all(flag in cpu_flags() for flag in ("avx512f", "avx512bw", "avx512_vnni"))


@pytest.mark.skipif(not avx512(), reason="one build only: this CPU has no AVX-512 VNNI")
@pytest.mark.parametrize("mode", tuple(cpu.ACTIVATIONS))
def test_the_avx2_build_gives_the_same_bits(qtype, blocks, mode):
    """AVX-512 takes 16 rows a register where AVX2 takes 8: the same arithmetic per row, the same bits."""
    if qtype != Q.Q8_0:
        pytest.skip("only Q8_0 packs on AVX2 builds")
    avx2 = cpu._open(("-mno-avx512f",))
    native = cpu.library()
    wide = np.concatenate([blocks.numpy()] * 22)  # 132 groups: AVX-512's sets of several groups
    n = wide.shape[0]
    for m in (1, 2, 5):
        x = np.random.default_rng(8).standard_normal((m, K), dtype=np.float32)
        out = {}
        for name, lib in (("avx2", avx2), ("native", native)):
            w = np.empty_like(wide)
            assert lib.sd_pack(int(Q.Q8_0), wide.ctypes.data, n, K, w.ctypes.data, 1) == 0
            y = np.empty((m, n), dtype=np.float32)
            assert lib.sd_matmul_packed(int(Q.Q8_0), w.ctypes.data, n, K, x.ctypes.data, m, y.ctypes.data, 2,
                                        cpu.activation_code(mode)) == 0
            out[name] = y.view(np.uint32)
        assert np.array_equal(out["avx2"], out["native"]), m


def test_what_packs_and_bad_input(qtype, blocks):
    assert cpu.packs(qtype, 32) and not cpu.packs(qtype, 24) and not cpu.packs(Q.Q4_0, 32)
    wide = all(flag in cpu_flags() for flag in ("avx512bw", "avx512vl", "avx512_vnni", "bmi2"))
    assert all(cpu.packs(q, 32) == wide for q in (Q.Q5_0, Q.Q4_K, Q.Q6_K))
    assert not cpu.tiles() or {"amx_tile", "amx_int8"} <= set(cpu_flags())
    with pytest.raises(ValueError, match="no packed layout"):
        cpu.pack(qtype, blocks[:24], K)
    with pytest.raises(ValueError, match="no packed layout"):
        cpu.Matrix(qtype, blocks[:24], K, packed=True)
    lib = cpu.library()
    assert lib.sd_matmul_packed(int(Q.Q4_0), ctypes.c_void_p(0), 16, K, None, 1, None, 1, 1) == -1


def test_a_packed_linear_joins_and_looks_up_like_the_file_layout(qtype, blocks):
    """`BlockLinear` with packed blocks: q, k and v joined stay packed and split back to each product."""
    parts = [BlockLinear(qtype, cpu.pack(qtype, blocks[lo:hi].contiguous(), K), K, packed=True)
             for lo, hi in ((0, 64), (64, 80), (80, 96))]
    plain = BlockLinear(qtype, blocks, K)
    qkv = Projections(parts)
    assert len(qkv.runs) == 1 and qkv.runs[0][0].matrix.packed
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(9))
    joined = torch.cat(qkv(x), dim=-1)
    assert np.array_equal(bits(joined), bits(torch.cat([p(x) for p in parts], dim=-1)))
    ids = torch.tensor([3, 70, 95])
    assert np.array_equal(bits(parts[0].lookup(ids[:1])), bits(plain.lookup(ids[:1])))
    assert np.array_equal(bits(qkv.runs[0][0].lookup(ids)), bits(plain.lookup(ids)))


def test_a_chunks_experts_round_their_rows_once_over_the_threads():
    """A prompt chunk's routed experts with more x values to round than a decode window's (`SD_CHUNK_FROM`,
    packed_cpu.c): each expert's gate and up share one rounding of its rows, the roundings run over the threads;
    the values of the file layout's products, and each row the bits of the row alone, on 1 and 2 threads."""
    from engine.experts import route
    from engine.kernels import ops

    if not (cpu.packs(Q.Q4_K, 16) and cpu.packs(Q.Q6_K, 16)):
        pytest.skip("no packed Q4_K/Q6_K layout here")
    experts, hidden, ff, top_k, rows = 8, 1024, 256, 4, 80  # 320 pairs of 1,024 values: over 2 ** 18

    def stack(qtype: Q, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        file = torch.stack([torch.from_numpy(random_blocks(qtype, n, k, seed=seed + e)) for e in range(experts)])
        return file, torch.stack([cpu.pack(qtype, b, k) for b in file])

    (gate, gate_p), (up, up_p), (down, down_p) = (stack(Q.Q4_K, ff, hidden, 10), stack(Q.Q4_K, ff, hidden, 30),
                                                  stack(Q.Q6_K, hidden, ff, 50))
    packed = ((int(Q.Q4_K) | cpu.PACKED_STACK, gate_p), (int(Q.Q4_K) | cpu.PACKED_STACK, up_p),
              (int(Q.Q6_K) | cpu.PACKED_STACK, down_p))
    file_layout = ((int(Q.Q4_K), gate), (int(Q.Q4_K), up), (int(Q.Q6_K), down))
    x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(7))
    weights, ids = route(x, torch.randn(experts, hidden, generator=torch.Generator().manual_seed(8)), top_k, True)
    before = cpu.threads()
    try:
        outs = []
        for n_threads in (1, 2):
            cpu.set_threads(n_threads)
            outs.append(ops.swiglu_experts(packed, x, ids, weights))
        reference = ops.swiglu_experts(file_layout, x, ids, weights)
    finally:
        cpu.set_threads(before)
    assert torch.equal(outs[0], outs[1])
    # the file layout's products round and sum in other orders: ~1e-4 of the largest here
    assert torch.allclose(outs[0], reference, rtol=0, atol=1e-3 * reference.abs().max().item())
    for i in (0, 41, 79):
        assert torch.equal(ops.swiglu_experts(packed, x[i:i + 1], ids[i:i + 1], weights[i:i + 1]), outs[0][i:i + 1])
