"""The Triton kernels over GGUF blocks (engine/kernels/triton_blocks.py) at small shapes: in Triton's
interpreter on the CPU (CI), compiled where there is a GPU. Every type against gguf-py's dequantizer:
exact dequantization, matvec and GEMM accuracy, rows bit-identical whatever the number of rows; the
CUDA format policy and `GpuBlockLinear`."""

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from triton_checks import (
    assert_close,
    assert_same_bits,
    gemm_tolerance,
    matvec_tolerance,
    reference,
    rounding_error,
)

from engine.gguf_file import TensorInfo
from engine.kernels import gpu
from engine.weights import Projections, WeightStore, keeps_blocks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = DEVICE == "cpu"

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from engine import linear_gpu  # noqa: E402
from engine.kernels import triton_blocks as tb  # noqa: E402
from engine.linear_gpu import GpuBlockLinear  # noqa: E402

N, K = 12, 768  # K: 3 super-blocks; N: a partial program of rows
# The one-row kernel in 2 steps (the second with masked groups); GEMM tiles (prompt chunks, and 2-8 rows
# of the float-sum types) of 16 rows of x and of W, 2 steps along k (the second masked).
TILES = tb.Tiles(row_k=512, row_blocks=2, gemm_m=16, gemm_n=16, gemm_k=512, small_n=16, small_k=512)
BF16_GEMM = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    INTERPRETED, reason="Triton's interpreter multiplies bf16 tiles as their uint16 bits"))


@pytest.fixture(params=gpu.SUPPORTED, ids=lambda t: t.name)
def case(request: pytest.FixtureRequest) -> tuple[tb.Matrix, torch.Tensor]:
    """A matrix of random blocks and gguf-py's values of it."""
    qtype = request.param
    blocks = tb.random_blocks(qtype, N, K, torch.Generator().manual_seed(int(qtype))).to(DEVICE)
    return tb.Matrix(qtype, blocks, K, TILES), reference(qtype, blocks)


def random_x(m: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, K, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def test_dequantize_matches_gguf_py(case):
    mat, ref = case
    assert_same_bits(mat.dequantize(), ref)
    assert_same_bits(mat.dequantize(dtype=torch.float16), ref.half())
    # float32 to bf16: the interpreter truncates, the GPU rounds to nearest even
    bf16 = (ref.view(torch.int32) & -65536).view(torch.float32) if INTERPRETED else ref
    assert_same_bits(mat.dequantize(dtype=torch.bfloat16), bf16.bfloat16())
    ids = torch.tensor([7, 0, 11, 7], device=DEVICE)
    assert_same_bits(mat.dequantize(ids), ref[ids])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_matvec_matches_reference(case, dtype):
    """2-8 rows: the int16 matvec (Q4_K, Q6_K), the GEMM's tiles of 16 rows for the other types."""
    mat, ref = case
    rounded = mat.qtype in tb.ROUNDED
    if INTERPRETED and dtype == torch.bfloat16 and not rounded:
        pytest.skip("Triton's interpreter multiplies bf16 tiles as their uint16 bits")
    x = random_x(tb.MATVEC_ROWS if dtype == torch.float32 else 3, dtype)
    tolerance = matvec_tolerance(dtype) if rounded else gemm_tolerance(dtype)
    assert_close(mat.matvec(x), x, ref, tolerance, rounding_error(x) if rounded else None)


@pytest.mark.parametrize(("qtype", "n", "k"), [(Q.Q4_K, 8, 4096), (Q.Q6_K, 32768, 256)], ids=["Q4_K-k4096", "Q6_K-head"])
def test_matvec_rows_with_the_tiles_of_their_shape(qtype, n, k):
    """2-8 rows of the shapes with tiles of their own (`Matrix._rows`): a Q4_K matrix of k >= 4096 (four
    weight rows, two warps), the Q6_K head of 32,768 rows and more (eight rows, one warp: run on its first
    12 rows here, the interpreter takes minutes for the whole)."""
    blocks = tb.random_blocks(qtype, n, k, torch.Generator().manual_seed(n)).to(DEVICE)
    mat, part = tb.Matrix(qtype, blocks, k), tb.Matrix(qtype, blocks[:12].clone(), k)
    # the int16 kernel: below head size a Q4_K matrix of this k takes the tensor cores instead (tested below)
    part._rows, part._mma = mat._rows, None
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(2)).to(DEVICE, torch.bfloat16)
    assert_close(part.matvec(x), x, reference(qtype, blocks[:12]), matvec_tolerance(x.dtype), rounding_error(x))


def test_the_q8_0_head_tiles():
    """The Q8_0 head (32,768 rows and more) has tiles of its own for one row (512 values a step, one warp) and
    for 2-8 rows (the GEMM in two warps, two stages): run on its first 12 rows here."""
    k = 1024  # two steps of 512
    blocks = tb.random_blocks(Q.Q8_0, 32768, k, torch.Generator().manual_seed(6)).to(DEVICE)
    mat, part = tb.Matrix(Q.Q8_0, blocks, k), tb.Matrix(Q.Q8_0, blocks[:12].clone(), k)
    assert (mat._float_row, mat._small_gemm, mat._mma) != (part._float_row, part._small_gemm, part._mma)
    # the head's: its 2-8 rows keep the GEMM where a smaller Q8_0 matrix takes the tensor cores
    part._float_row, part._small_gemm, part._mma = mat._float_row, mat._small_gemm, mat._mma
    ref = reference(Q.Q8_0, blocks[:12])
    for rows in (1, 3):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(DEVICE)
        tolerance = matvec_tolerance(x.dtype) if rows == 1 else gemm_tolerance(x.dtype)
        assert_close(part.matvec(x), x, ref, tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_q6_k_heads_rows_on_the_tensor_cores(dtype):
    """The Q6_K head's (32,768 rows and more) windows of 2-8 rows take the int8 tensor-core kernel: run on the
    head's first 40 rows (two programs, the second partial)."""
    k = 512
    blocks = tb.random_blocks(Q.Q6_K, 32768, k, torch.Generator().manual_seed(9)).to(DEVICE)
    mat, part = tb.Matrix(Q.Q6_K, blocks, k), tb.Matrix(Q.Q6_K, blocks[:40].clone(), k)
    assert mat._mma is not None and part._mma is None
    check_tensor_cores(part, mat._mma, dtype)


@pytest.mark.parametrize(("qtype", "parts"), [(Q.Q4_K, 1), (Q.Q4_K, 3), (Q.Q6_K, 3), (Q.Q8_0, 3)], ids=str)
def test_rows_on_the_tensor_cores_with_k_in_parts(qtype, parts):
    """k cut into parts (programs of their own, added in order after): the same sums to float rounding, each
    row's bits whatever the window."""
    k = 768
    blocks = tb.random_blocks(qtype, 40, k, torch.Generator().manual_seed(parts)).to(DEVICE)
    mat = tb.Matrix(qtype, blocks, k)
    check_tensor_cores(mat, tb.MmaTiles(16, 1, 2, parts), torch.float32)
    mat._mma = tb.MmaTiles(16, 1, 2, 2)
    with pytest.raises(ValueError, match="not 2 parts"):
        mat.matvec(torch.zeros(2, k, device=DEVICE))


@pytest.mark.parametrize(("qtype", "n", "k", "tiles"), [
    (Q.Q4_K, 5120, 2048, tb.MmaTiles(32, 1, 2, 4)), (Q.Q4_K, 2048, 4096, tb.MmaTiles(32, 1, 2, 8)),
    (Q.Q8_0, 512, 2048, tb.MmaTiles(32, 2, 2, 4)), (Q.Q8_0, 64, 1536, tb.MmaTiles(32, 2, 2, 2)),
    (Q.Q4_K, 2048, 768, None), (Q.Q6_K, 512, 2048, None), (Q.Q4_0, 2048, 4096, None),
    (Q.Q6_K, 151936, 2048, tb.MmaTiles(32, 2, 2)), (Q.Q8_0, 151936, 2048, None), (Q.Q4_K, 151936, 2048, None)],
    ids=str)
def test_which_matrices_take_the_tensor_cores(qtype, n, k, tiles):
    """Q4_K and Q8_0 below head size with k cut into parts of 512 values (a whole number of 256-value steps each,
    at most 8), the Q6_K head in one part; the others keep the int16 kernel or the GEMM."""
    assert tb.mma_tiles(qtype, n, k) == tiles


def test_q8_0_keeps_the_gemm_where_k_is_not_whole_steps(monkeypatch):
    """The tensor cores take k 256 values a step: a Q8_0 matrix of k = 96 keeps its GEMM whatever `mma_tiles`
    names, and tiles forced on it are refused rather than summing none of k."""
    monkeypatch.setattr(tb, "mma_tiles", lambda *shape: tb.MmaTiles(16, 1, 2))
    blocks = tb.random_blocks(Q.Q8_0, 40, 96, torch.Generator().manual_seed(1)).to(DEVICE)
    mat = tb.Matrix(Q.Q8_0, blocks, 96)
    assert mat._mma is None
    mat._mma = tb.MmaTiles(16, 1, 2)
    with pytest.raises(ValueError, match="not 1 parts"):
        mat.matvec(torch.zeros(2, 96, device=DEVICE))


@triton.jit
def _weight_values_kernel(ql0, ql1, qh, out, ASM: tl.constexpr):
    """out [6, 32, 32]: `_q6k_runs` of the bytes ql0, ql1, qh [32, 32], then `_nibbles` of ql0."""
    at = tl.arange(0, 32)[:, None] * 32 + tl.arange(0, 32)[None, :]
    a, b, h = tl.load(ql0 + at), tl.load(ql1 + at), tl.load(qh + at)
    runs = tb._q6k_runs(a, b, h, ASM)
    for r in tl.static_range(4):
        tl.store(out + r * 1024 + at, runs[r])
    low, high = tb._nibbles(a, ASM)
    tl.store(out + 4 * 1024 + at, low)
    tl.store(out + 5 * 1024 + at, high)


@pytest.mark.parametrize("asm", [False, pytest.param(True, marks=pytest.mark.skipif(
    INTERPRETED, reason="PTX runs on a GPU only"))], ids=["formula", "ptx"])
def test_the_tensor_cores_weight_values_from_their_bytes(asm):
    """The int8 values the tensor-core products take from a Q6_K half-block's bytes (run r = 2u + j: nibble u of
    ql slice j, bits 2r of qh above it, - 32) and from Q4_K's (the nibbles), for every byte value; on a GPU the
    PTX that works on four bytes a word gives the same."""
    ql0, ql1, qh = (torch.randperm(1024, generator=torch.Generator().manual_seed(i)).remainder(256).to(torch.uint8)
                    .reshape(32, 32) for i in range(3))
    out = torch.empty(6, 32, 32, dtype=torch.int8, device=DEVICE)
    _weight_values_kernel[(1,)](ql0.to(DEVICE), ql1.to(DEVICE), qh.to(DEVICE), out, ASM=asm, num_warps=1)
    a, b, h = ql0.int(), ql1.int(), qh.int()
    runs = [(((b if r % 2 else a) >> (4 * (r // 2))) & 15 | ((h >> (2 * r)) & 3) << 4) - 32 for r in range(4)]
    assert torch.equal(out.cpu().int(), torch.stack(runs + [a & 15, a >> 4]))


def check_tensor_cores(mat: tb.Matrix, tiles: tb.MmaTiles, dtype: torch.dtype) -> None:
    """`mat`'s 2-8 rows on the tensor cores with `tiles`: for Q4_K and Q6_K the int16 kernel's integer sums, so
    its results to float rounding (Q8_0's windows otherwise take the GEMM over x unrounded); each row's bits
    whatever the window; one row keeps its own kernel."""
    x = torch.randn(tb.MATVEC_ROWS, mat.k, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    mat._mma = None
    int16, one = mat.matvec(x), mat.matvec(x[:1])
    mat._mma = tiles
    y = mat.matvec(x)
    assert_close(y, x, reference(mat.qtype, mat.blocks), matvec_tolerance(dtype), rounding_error(x))
    if dtype == torch.float32 and mat.qtype in tb.ROUNDED:
        torch.testing.assert_close(y, int16, rtol=1e-5, atol=1e-5 * int16.abs().max().item())
    assert_same_bits(mat.matvec(x[:1]), one)
    for i in range(tb.MATVEC_ROWS - 1):
        assert_same_bits(mat.matvec(x[i:i + 2]), y[i:i + 2])
    assert_same_bits(mat.matvec(x[2:7]), y[2:7])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_one_row_matches_reference(case, dtype):
    mat, ref = case
    x = random_x(1, dtype, seed=4)
    rounded = rounding_error(x) if mat.qtype in tb.ROUNDED else None  # their one row sums x rounded to int16
    assert_close(mat.matvec(x), x, ref, matvec_tolerance(dtype), rounded)


def test_matvec_rows_do_not_depend_on_m(case):
    """Windows of 2-8 rows share the bits of each row (one row is a kernel of its own)."""
    mat, _ = case
    if INTERPRETED and mat.qtype not in tb.ROUNDED:
        pytest.skip("their 2-8 rows take the GEMM: the interpreter runs tl.dot as numpy's matmul, whose sums "
                    "depend on a row's place in the tile")
    x = random_x(tb.MATVEC_ROWS, torch.bfloat16, seed=2)
    together = mat.matvec(x)
    for i in range(tb.MATVEC_ROWS - 1):
        assert_same_bits(mat.matvec(x[i:i + 2]), together[i:i + 2])
    assert_same_bits(mat.matvec(x[2:7]), together[2:7])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16_GEMM], ids=str)
def test_gemm_matches_reference(case, dtype):
    mat, ref = case
    x = random_x(20, dtype)  # two tiles of x, the second partial
    assert_close(mat.gemm(x), x, ref, gemm_tolerance(dtype))


@pytest.mark.skipif(INTERPRETED, reason="Triton's interpreter runs tl.dot as numpy's matmul, whose sums "
                    "depend on a row's place in the tile (the GPU's tensor cores do not)")
def test_gemm_rows_do_not_depend_on_m(case):
    mat, _ = case
    x = random_x(20, torch.bfloat16, seed=3)
    assert_same_bits(mat.gemm(x[3:14]), mat.gemm(x)[3:14])  # other rows, other places in the tile


def test_matmul_dispatch_and_bad_input():
    blocks = tb.random_blocks(Q.Q8_0, N, 64).to(DEVICE)
    mat = tb.Matrix(Q.Q8_0, blocks, 64, TILES)
    x = torch.randn(tb.MATVEC_ROWS + 1, 64, device=DEVICE)
    assert_same_bits(mat.matmul(x[:tb.MATVEC_ROWS]), mat.matvec(x[:tb.MATVEC_ROWS]))
    assert_same_bits(mat.matmul(x), mat.gemm(x))
    assert mat.matmul(x[:0]).shape == (0, N)
    unaligned = torch.empty(64 + 1, device=DEVICE)[1:].view(1, 64).copy_(x[:1])  # copied to 16-byte alignment
    assert_same_bits(mat.matvec(unaligned), mat.matvec(x[:1]))
    with pytest.raises(ValueError, match="at most"):
        mat.matvec(x)
    with pytest.raises(ValueError, match="x must be"):
        mat.matvec(x[:2].double())
    with pytest.raises(ValueError, match="x must be"):
        mat.gemm(x[:, :32])
    with pytest.raises(ValueError, match="multiple"):
        tb.Matrix(Q.Q4_K, blocks, 64)
    with pytest.raises(ValueError, match="blocks must be"):
        tb.Matrix(Q.Q8_0, blocks[:, :-2], 64)
    with pytest.raises(ValueError, match="no Triton kernel"):
        tb.Matrix(Q.Q5_0, blocks, 64)


def test_gpu_block_linear(monkeypatch):
    k = 64
    blocks = tb.random_blocks(Q.Q8_0, N, k)
    lin = GpuBlockLinear(Q.Q8_0, blocks, k, torch.device(DEVICE))
    assert (lin.out_features, lin.in_features, lin.nbytes) == (N, k, blocks.numel())
    dense = lin.matrix.dequantize()
    for rows in (3, tb.MATVEC_ROWS + 2, linear_gpu.DEQUANTIZED_ROWS // 2):
        x = torch.randn(2, rows, k, device=DEVICE)
        y = lin(x)
        assert y.shape == (2, rows, N)
        assert_close(y.reshape(-1, N), x.reshape(-1, k), dense, gemm_tolerance(torch.float32))
    x = torch.randn(linear_gpu.DEQUANTIZED_ROWS, k, device=DEVICE)  # the matrix dequantized, torch's product
    assert_same_bits(lin(x), torch.mm(x, dense.t()))
    assert_same_bits(lin(x), lin(x))  # run after run
    monkeypatch.setattr(linear_gpu, "DEQUANTIZED_BYTES", N * k * 4 - 1)  # its copy too large: the tile GEMM
    assert_same_bits(lin(x), lin.matrix.gemm(x))
    ids = torch.tensor([[4, 1]], device=DEVICE)
    assert_same_bits(lin.lookup(ids), dense[[4, 1]])


def test_gpu_block_linears_join_into_one_matrix():
    """`Projections` over a layer's q and k (Q8_0) and v (Q4_K): one matrix for q and k, each output its
    own product's values."""
    gen = torch.Generator().manual_seed(5)
    parts = [GpuBlockLinear(qtype, tb.random_blocks(qtype, n, 256, gen), 256, torch.device(DEVICE))
             for qtype, n in ((Q.Q8_0, 16), (Q.Q8_0, 8), (Q.Q4_K, 8))]
    x = torch.randn(1, 256, device=DEVICE)
    want = [p(x) for p in parts]
    joined = Projections(parts)
    assert [(m.matrix.qtype, sizes) for m, sizes in joined.runs] == [(Q.Q8_0, [16, 8]), (Q.Q4_K, [8])]
    for got, ref in zip(joined(x), want, strict=True):
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5)


def info(name: str, shape: tuple[int, ...], qtype: Q) -> TensorInfo:
    return TensorInfo(name, shape, qtype, offset=0, nbytes=0)


def test_cuda_policy_keeps_the_blocks_the_kernels_read(monkeypatch):
    cuda = torch.device("cuda")
    assert keeps_blocks(info("blk.0.attn_q.weight", (64, 256), Q.Q4_K), cuda)
    assert keeps_blocks(info("output.weight", (64, 256), Q.Q6_K), cuda)
    assert not keeps_blocks(info("blk.0.attn_q.weight", (64, 256), Q.F16), cuda)  # dense bf16 needs no kernel
    assert not keeps_blocks(info("blk.0.attn_q.weight", (64, 256), Q.Q5_0), cuda)
    assert keeps_blocks(info("blk.0.ffn_up_exps.weight", (8, 64, 256), Q.Q4_K), cuda)  # the fused MoE kernel
    assert not keeps_blocks(info("blk.0.attn_norm.weight", (256,), Q.Q8_0), cuda)
    assert WeightStore(None, cuda, torch.bfloat16).describe() == ""

    monkeypatch.setattr(gpu, "unavailable_reason", lambda: "triton is not importable: test")
    assert not keeps_blocks(info("blk.0.attn_q.weight", (64, 256), Q.Q4_K), cuda)
    assert WeightStore(None, cuda, torch.bfloat16).describe() == (
        "; GPU kernels unavailable (triton is not importable: test): matrices dequantized")


@pytest.mark.parametrize(("dtype", "largest"), [(torch.int16, 32767), (torch.int8, 127)], ids=["int16", "int8"])
def test_x_rounded_per_group(dtype, largest):
    """`triton_xq.RoundedRows`: q * scale within half a step of x, scale = max |x| / 32767 (int8: 127) per 32
    values, float sums per group, q's sums per 16 values, an all-zero group rounded to zeros; each row on its
    own; int16 values split into the tensor cores' planes."""
    from engine.kernels.triton_xq import RoundedRows

    x = random_x(3, torch.bfloat16, seed=6)
    x[1, 32:64] = 0
    r = RoundedRows.of(x, dtype)
    groups = x.float().view(3, -1, 32)
    top = groups.abs().amax(-1)
    assert r.q.dtype == dtype and torch.equal(r.scale, top / largest)
    back = r.q.float().view(3, -1, 32) * r.scale[..., None]
    # half a step, and float32's rounding of scale and of q * scale (bf16's x falls on half steps of 127)
    assert ((back - groups).abs() <= r.scale[..., None] / 2 * (1 + 1e-6) + groups.abs() * 2**-22).all()
    assert torch.allclose(r.sums, groups.sum(-1), rtol=1e-6, atol=1e-6)
    assert torch.equal(r.halves, r.q.int().view(3, -1, 16).sum(-1))
    assert not r.q[1, 32:64].any() and r.scale[1, 1] == 0
    assert torch.equal(RoundedRows.of(x[2:3], dtype).q, r.q[2:3])
    assert int(r.q.max()) == largest and int(r.q.min()) <= -largest * 0.97  # the ends are reached
    if dtype == torch.int8:
        with pytest.raises(ValueError, match="int16"):
            r.planes()
        with pytest.raises(ValueError, match="int16"):
            RoundedRows.empty(3, x.shape[1], x.device, dtype, planes=True)
        with pytest.raises(ValueError, match="int16 or int8"):
            RoundedRows.of(x, torch.int32)
        return
    hi, lo = r.planes()  # the tensor cores' int8 planes: q = 256 hi + lo + 128
    assert hi.dtype == lo.dtype == torch.int8 and torch.equal(256 * hi.int() + lo.int() + 128, r.q.int())


def assert_same_rounding(got, want) -> None:
    """Two `RoundedRows` equal: the int16 values, scales and q sums bit for bit, the float sums of a group to
    float32 rounding (summed in another order on a GPU); the int8 planes bit for bit where `got` has them."""
    assert torch.equal(got.q, want.q) and torch.equal(got.scale, want.scale) and torch.equal(got.halves, want.halves)
    assert torch.allclose(got.sums, want.sums, rtol=1e-6, atol=1e-6)
    if got.hi is not None:
        assert all(torch.equal(a, b) for a, b in zip(got.planes(), want.planes(), strict=True))


def test_rounding_wanted_on_cuda_is_wanted_on_the_current_device(monkeypatch):
    """`want(torch.device("cuda"))` holds for the device the kernels look up, a tensor's ("cuda:1" here)."""
    from engine.kernels import triton_xq

    monkeypatch.setattr(triton_xq, "_wanted", set())
    monkeypatch.setattr(triton_xq, "_planes_wanted", set())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    triton_xq.RoundedRows.want(torch.device("cuda"), planes=True)
    assert triton_xq.RoundedRows.wanted(torch.device("cuda", 1))
    assert triton_xq._planes_wanted == {torch.device("cuda", 1)}


@pytest.mark.parametrize("d", [2048, 640])
def test_the_norms_round_the_rows_they_write(d):
    """`rms_norm` and `add_rms_norm` of up to MATVEC_ROWS rows round what they store in the same launch:
    `RoundedRows.of(y)` is that rounding (no launch), the same as rounding y apart, with the int8 planes of 2-8 rows
    where the tensor cores want them; more rows are not rounded there; a write into y forgets it."""
    from engine.kernels import triton_rows
    from engine.kernels.triton_xq import RoundedRows, _made

    RoundedRows.want(torch.device(DEVICE))  # as a Q4_K or Q6_K matrix on the device says
    x = (torch.randn(3, d, generator=torch.Generator().manual_seed(7)) * 3).to(DEVICE, torch.bfloat16)
    weight = torch.randn(d, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    y = triton_rows.rms_norm(x, weight, 1e-6)
    assert _made[y.device][0].data_ptr() == y.data_ptr()
    assert_same_rounding(RoundedRows.of(y), RoundedRows.of(y.clone()))
    s, y2 = triton_rows.add_rms_norm(x, x, weight, 1e-6)
    assert RoundedRows.of(y2) is _made[y2.device][2]
    assert_same_rounding(RoundedRows.of(y2), RoundedRows.of(y2.clone()))
    y2.mul_(2)  # in place: the remembered rounding is of the old values
    assert_same_rounding(RoundedRows.of(y2), RoundedRows.of(y2.clone()))
    RoundedRows.want(torch.device(DEVICE), planes=True)  # as a matrix on the tensor cores says: planes too
    for rows in (x, x[:1]):
        y = triton_rows.rms_norm(rows, weight, 1e-6)
        made = RoundedRows.of(y)
        assert (made.hi is not None) == (len(rows) > 1)  # one row takes the int16 kernel, not the planes
        assert_same_rounding(made, RoundedRows.of(y.clone()))
    many = triton_rows.rms_norm(x.repeat(3, 1), weight, 1e-6)  # 9 rows: the prompt's GEMM takes them, unrounded
    assert _made[many.device][0].data_ptr() != many.data_ptr()
    with torch.inference_mode():  # the engine's mode: its tensors count no versions
        y = triton_rows.rms_norm(x, weight, 1e-6)
        assert RoundedRows.of(y) is _made[y.device][2]
        assert_same_rounding(RoundedRows.of(y), RoundedRows.of(y.clone()))


def test_the_norms_leave_the_rounding_where_no_product_takes_it(monkeypatch):
    """On a device without a matrix or expert stack of a `ROUNDED` type (a Q8_0 or F16 file) the norms store
    their rows only; a product that asks for the rounding then makes it apart."""
    from engine.kernels import triton_rows, triton_xq
    from engine.kernels.triton_xq import RoundedRows

    monkeypatch.setattr(triton_xq, "_wanted", set())
    monkeypatch.setattr(triton_xq, "_made", {})
    x = torch.randn(3, 2048, generator=torch.Generator().manual_seed(9)).to(DEVICE, torch.bfloat16)
    y = triton_rows.rms_norm(x, torch.ones(2048, device=DEVICE), 1e-6)
    assert not RoundedRows.wanted(y.device) and y.device not in triton_xq._made
    tb.Matrix(Q.Q4_K, tb.random_blocks(Q.Q4_K, 4, 256, torch.Generator().manual_seed(1)).to(DEVICE), 256)
    assert RoundedRows.wanted(y.device)
    y = triton_rows.rms_norm(x, torch.ones(2048, device=DEVICE), 1e-6)
    assert triton_xq._made[y.device][0].data_ptr() == y.data_ptr()
