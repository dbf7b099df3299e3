"""The weight store: formats kept as in the file, bytes counted where they are placed, and the
products of a block matrix equal to the float product of its dequantized weights."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants
from test_cpu_kernels import random_blocks

from engine.gguf_file import GGUFFile
from engine.kernels import cpu as cpu_kernels
from engine.loading import open_model
from engine.weights import (
    MATVEC_ROWS,
    PACKED_MATVEC_ROWS,
    BlockLinear,
    DenseLinear,
    Projections,
    is_vector,
    planned_bytes,
)

CPU = torch.device("cpu")
needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason=f"CPU kernels: {cpu_kernels.unavailable_reason()}")


@needs_kernels
def test_demo_weights_stay_in_file_format(demo_model):
    g, model = open_model(str(demo_model), "cpu", context=256)
    file_bytes = sum(t.nbytes for t in g.tensors.values() if not is_vector(t))
    placed = model.w.bytes(lambda name: not is_vector(g.tensors[name]))
    assert placed <= 1.05 * file_bytes, (placed, file_bytes)
    assert model.w.bytes() == planned_bytes(g, CPU, model.dtype)
    assert model.w.split() == {"cpu": model.w.bytes()}
    assert "Q8_0 blocks" in model.w.describe() and "Q5_0 blocks" in model.w.describe()
    b = model.blk[0]  # q, k, v and the FFN's gate and up each joined (one product a run of one type)
    assert isinstance(b.attn_qkv, Projections) and isinstance(b.ffn_gate_up, Projections)
    assert not hasattr(b, "ffn_gate") and not hasattr(b, "attn_q")
    gate, up = b.ffn_gate_up(torch.randn(1, model.hyper.hidden))
    assert gate.shape == up.shape == (1, g.tensors["blk.0.ffn_gate.weight"].shape[0])


def test_dense_policy_counts_dequantized_bytes(tiny_model_q8):
    g = GGUFFile(tiny_model_q8)
    cuda_like = torch.device("meta")  # not the CPU: the policy dequantizes
    f32 = sum(int(np.prod(t.shape)) * 4 for t in g.tensors.values())
    assert planned_bytes(g, cuda_like, torch.float32) == f32
    bf16 = planned_bytes(g, cuda_like, torch.bfloat16)
    assert bf16 < f32


@needs_kernels
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q5_0, Q.Q4_0])
@pytest.mark.parametrize("rows", [1, 3, MATVEC_ROWS + 5])
def test_block_linear_matches_dequantized_product(qtype, rows):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((96, 512)).astype(np.float32)
    blocks = quants.quantize(w, qtype)
    dense = torch.from_numpy(quants.dequantize(blocks, qtype))
    lin = BlockLinear(qtype, torch.from_numpy(blocks), 512, activations="float")  # float activations: exact products
    lin.slab_rows = 40  # several slabs in the prompt-chunk path
    x = torch.randn(rows, 512)
    got = lin(x)
    ref = (x.double() @ dense.double().T).float()
    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-3), (got - ref).abs().max()
    ids = torch.tensor([5, 0, 95])
    assert torch.equal(lin.lookup(ids), dense[ids])


@pytest.mark.skipif(not cpu_kernels.packs(Q.Q8_0, 16), reason="no packed Q8_0 layout on this build")
def test_packed_block_linear_runs_its_kernel_up_to_its_rows():
    """A packed matrix's products: the kernel up to its type's PACKED_MATVEC_ROWS rows (no slab dequantized), slabs
    and a GEMM above, both the dequantized product."""
    rng = np.random.default_rng(2)
    blocks = quants.quantize(rng.standard_normal((96, 512)).astype(np.float32), Q.Q8_0)
    dense = torch.from_numpy(quants.dequantize(blocks, Q.Q8_0))
    lin = BlockLinear(Q.Q8_0, cpu_kernels.pack(Q.Q8_0, torch.from_numpy(blocks), 512), 512, activations="float",
                      packed=True)
    slabs = []
    dequantize = lin.matrix.dequantize
    lin.matrix.dequantize = lambda lo, hi: slabs.append((lo, hi)) or dequantize(lo, hi)
    most = PACKED_MATVEC_ROWS[Q.Q8_0]
    for rows, sliced in ((3, False), (most, False), (most + 1, True)):
        slabs.clear()
        x = torch.randn(rows, 512)
        got = lin(x)
        ref = (x.double() @ dense.double().T).float()
        assert torch.allclose(got, ref, rtol=1e-4, atol=1e-3), (got - ref).abs().max()
        assert bool(slabs) == sliced, rows


@pytest.mark.skipif(not cpu_kernels.available() or not cpu_kernels.tiles(), reason="no AMX tiles here")
@pytest.mark.parametrize("qtype, rows, tiled", ((Q.Q8_0, 2100, True), (Q.Q5_0, 300, True), (Q.Q4_K, 2100, True),
                                                (Q.Q6_K, 512, True), (Q.Q6_K, 513, False)))
def test_a_tiled_linear_runs_its_kernel_to_its_tiled_rows(qtype, rows, tiled):
    """Where packed products run on AMX tiles the integer modes take the kernel to TILED_MATVEC_ROWS (past
    PACKED_MATVEC_ROWS), slabs above; float activations slabs above PACKED_MATVEC_ROWS."""
    assert PACKED_MATVEC_ROWS[qtype] < rows
    blocks = cpu_kernels.pack(qtype, _blocks(qtype, 32, 256, 4), 256)
    x = torch.randn(rows, 256)
    for activations, sliced in (("int16", not tiled), ("int8", not tiled), ("float", True)):
        lin = BlockLinear(qtype, blocks, 256, activations=activations, packed=True)
        slabs = []
        dequantize = lin.matrix.dequantize
        lin.matrix.dequantize = lambda lo, hi, d=dequantize, s=slabs: s.append((lo, hi)) or d(lo, hi)
        got = lin(x)
        assert bool(slabs) == sliced, activations
        if not sliced:
            assert torch.equal(got, lin.matrix.matmul(x, activations=activations))


def _blocks(qtype: Q, n: int, k: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(random_blocks(qtype, n, k, seed))


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, MATVEC_ROWS + 5])
def test_projections_join_runs_of_one_type_and_give_each_matrix_its_product(rows):
    """q and k of one type become one matrix (one product), v of another type stays alone; each output
    is the bits its own matrix gives (a row's sums do not depend on the rows beside it)."""
    parts = [BlockLinear(Q.Q4_K, _blocks(Q.Q4_K, 64, 256, 1), 256), BlockLinear(Q.Q4_K, _blocks(Q.Q4_K, 32, 256, 2), 256),
             BlockLinear(Q.Q6_K, _blocks(Q.Q6_K, 32, 256, 3), 256)]
    x = torch.randn(rows, 256)
    want = [p(x) for p in parts]
    joined = Projections(parts)
    assert [sizes for _, sizes in joined.runs] == [[64, 32], [32]]
    got = joined(x)
    assert len(got) == 3 and all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_projections_join_dense_matrices():
    parts = [DenseLinear(torch.randn(n, 16)) for n in (8, 4, 4)]
    x = torch.randn(2, 16)
    joined = Projections(parts)
    assert [sizes for _, sizes in joined.runs] == [[8, 4, 4]]
    assert all(torch.allclose(g, p(x)) for g, p in zip(joined(x), parts, strict=True))


def test_dense_linear_takes_x_of_another_dtype():
    """An F16 expert stack kept for the fused kernel gives `DenseLinear` views of its values; where a layer's
    other stacks run one expert at a time they take the compute dtype's x: the product in the weight's dtype,
    returned in x's."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(8, 32, generator=gen).half()
    x = torch.randn(2, 32, generator=gen).bfloat16()
    y = DenseLinear(w)(x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, torch.nn.functional.linear(x.half(), w).bfloat16())
