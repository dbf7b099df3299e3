"""A Q6_K matrix unpacked to int8 (engine/kernels/triton_unpacked.py): in Triton's interpreter on the CPU (CI),
compiled where there is a GPU. The unpacked values against gguf-py's, the kernel's weights the dequantized copy's
bit for bit, its products within the reference's bound, each row's bits whatever the window (compiled)."""

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from triton_checks import assert_close, assert_same_bits, gemm_tolerance, reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = DEVICE == "cpu"

pytest.importorskip("triton")

from engine.kernels import triton_blocks as tb  # noqa: E402
from engine.kernels.triton_unpacked import Unpacked, UnpackedTiles, unpack_q6k, unpacked_bytes  # noqa: E402

N, K = 40, 768  # two programs of 32 weight rows (the second partial), 3 blocks
TILES = UnpackedTiles(rows=32, k=256, warps=2, stages=2)
# x in f16 in the interpreter: it multiplies bf16 tiles as their uint16 bits
DTYPES = (torch.float16,) if INTERPRETED else (torch.float16, torch.bfloat16)


def blocks_of(seed: int, n: int = N, k: int = K) -> torch.Tensor:
    """n rows of k random Q6_K values' blocks."""
    return tb.random_blocks(Q.Q6_K, n, k, torch.Generator().manual_seed(seed)).to(DEVICE)


def test_unpacked_values_are_gguf_pys():
    """q * (d * the sub-block's scale) is gguf-py's value of every weight, bit for bit."""
    blocks = blocks_of(1)
    q, scales, d = unpack_q6k(blocks, K)
    assert (q.dtype, scales.dtype, d.dtype) == (torch.int8, torch.int8, torch.float16)
    values = q.float().view(N, K // 16, 16) * (d.float().repeat_interleave(16, dim=1) * scales.float())[..., None]
    assert_same_bits(values.view(N, K), reference(Q.Q6_K, blocks))


@pytest.mark.parametrize(("k", "step"), [(768, 256), (768, 128), (1024, 512)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_kernels_weights_are_the_dequantized_copys(dtype, k, step):
    """Rows of x that pick one column each: y is that column of the matrix dequantized to x's dtype (equal values: a
    weight of -0 sums to +0), with steps of half a block, one and two."""
    blocks = blocks_of(2, k=k)
    unpacked = Unpacked(blocks, k, UnpackedTiles(rows=32, k=step, warps=2, stages=2))
    copy = tb.Matrix(Q.Q6_K, blocks, k).dequantize(dtype=dtype)
    columns = torch.tensor([0, 17, 255, 256, 400, 511, 600, k - 1])
    x = torch.zeros(len(columns), k, dtype=dtype, device=DEVICE)
    x[torch.arange(len(columns)), columns] = 1
    assert torch.equal(unpacked.matvec(x), copy[:, columns.to(DEVICE)].t())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_products_are_within_the_references_bound(dtype):
    blocks = blocks_of(3)
    unpacked = Unpacked(blocks, K, TILES)
    x = torch.randn(tb.MATVEC_ROWS, K, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    y = unpacked.matvec(x)
    assert_close(y, x, reference(Q.Q6_K, blocks), gemm_tolerance(dtype))
    if not INTERPRETED:  # numpy's matmul sums a row by its place in the tile; the tensor cores do not
        for i in range(tb.MATVEC_ROWS - 1):
            assert_same_bits(unpacked.matvec(x[i:i + 2]), y[i:i + 2])
        assert_same_bits(unpacked.matvec(x[2:7]), y[2:7])


def test_bad_input():
    blocks = blocks_of(4)
    with pytest.raises(ValueError, match="uint8"):
        unpack_q6k(blocks[:, :-2], K)
    with pytest.raises(ValueError, match="whole steps"):
        Unpacked(blocks, K, UnpackedTiles(k=512))
    unpacked = Unpacked(blocks, K, TILES)
    half = torch.float16
    for bad in (torch.zeros(1, K, dtype=half), torch.zeros(9, K, dtype=half), torch.zeros(2, K - 256, dtype=half),
                torch.zeros(2, K)):  # one row, nine, another k, float32
        with pytest.raises(ValueError, match="x must be"):
            unpacked.matvec(bad.to(DEVICE))
    assert unpacked.nbytes == unpacked_bytes(N, K) == N * K + N * K // 16 + N * K // 256 * 2
