"""A Q6_K matrix unpacked to int8 for the tensor cores (engine/kernels/triton_unpacked.py): in Triton's interpreter
on the CPU (CI), compiled where there is a GPU. The unpacked values against gguf-py's, the products bit for bit
those of the blocks' tensor-core kernel, each row's bits whatever the window."""

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from triton_checks import assert_close, assert_same_bits, matvec_tolerance, reference, rounding_error

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytest.importorskip("triton")

from engine.kernels import triton_blocks as tb  # noqa: E402
from engine.kernels.triton_unpacked import Unpacked, UnpackedTiles, unpack_q6k  # noqa: E402

N, K = 40, 768  # two programs of 32 weight rows (the second partial), 3 blocks


def blocks_of(seed: int, n: int = N, k: int = K) -> torch.Tensor:
    return tb.random_blocks(Q.Q6_K, n, k, torch.Generator().manual_seed(seed)).to(DEVICE)


def test_unpacked_values_are_gguf_pys():
    """q * (d * the sub-block's scale) is gguf-py's value of every weight, bit for bit."""
    blocks = blocks_of(1)
    q, scales, d = unpack_q6k(blocks, K)
    assert (q.dtype, scales.dtype, d.dtype) == (torch.int8, torch.int8, torch.float16)
    values = q.float().view(N, K // 16, 16) * (d.float().repeat_interleave(16, dim=1) * scales.float())[..., None]
    assert_same_bits(values.view(N, K), reference(Q.Q6_K, blocks))


@pytest.mark.parametrize("parts", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_products_are_the_blocks_tensor_core_sums(dtype, parts):
    """2-8 rows: within the reference's bound, the same bits as `_mma_kernel` over the blocks (the same integer
    sums and floats), each row's bits whatever the window; k in parts too."""
    blocks = blocks_of(2)
    unpacked = Unpacked(blocks, K, UnpackedTiles(rows=32, warps=2, stages=2, parts=parts))
    mat = tb.Matrix(Q.Q6_K, blocks, K)
    mat._mma = tb.MmaTiles(32, 2, 2, parts)
    x = torch.randn(tb.MATVEC_ROWS, K, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    y = unpacked.matvec(x)
    assert_close(y, x, reference(Q.Q6_K, blocks), matvec_tolerance(dtype), rounding_error(x))
    assert_same_bits(y, mat.matvec(x))
    for i in range(tb.MATVEC_ROWS - 1):
        assert_same_bits(unpacked.matvec(x[i:i + 2]), y[i:i + 2])
    assert_same_bits(unpacked.matvec(x[2:7]), y[2:7])


def test_bad_input():
    blocks = blocks_of(4)
    with pytest.raises(ValueError, match="uint8"):
        unpack_q6k(blocks[:, :-2], K)
    with pytest.raises(ValueError, match="parts"):
        Unpacked(blocks, K, UnpackedTiles(parts=2))
    unpacked = Unpacked(blocks, K)
    for bad in (torch.zeros(1, K), torch.zeros(9, K), torch.zeros(2, K - 256)):
        with pytest.raises(ValueError, match="x must be"):
            unpacked.matvec(bad.to(DEVICE))
    assert unpacked.nbytes == N * K + N * K // 16 + N * K // 256 * 2
