"""Q4_K and Q6_K products of 2-8 rows on tiles dequantized from the blocks (engine/kernels/triton_tiles.py): in
Triton's interpreter on the CPU (CI), compiled where there is a GPU. The kernel's weights the dequantized copy's bit
for bit, its products within the reference's bound, each row's bits whatever the window (compiled)."""

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from triton_checks import assert_close, assert_same_bits, gemm_tolerance, reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = DEVICE == "cpu"

pytest.importorskip("triton")

from engine.kernels import triton_blocks as tb  # noqa: E402
from engine.kernels.triton_tiles import BlockTiles, TileLaunch  # noqa: E402

N, K = 40, 1024  # two programs of 32 weight rows (the second partial), 4 blocks
LAUNCHES = (TileLaunch(rows=32, warps=2, stages=2), TileLaunch(rows=16, warps=1, stages=2, parts=2),
            TileLaunch(rows=32, warps=2, stages=2, parts=4))
TYPES = (Q.Q4_K, Q.Q6_K)
# x in f16 in the interpreter: it multiplies bf16 tiles as their uint16 bits
DTYPES = (torch.float16,) if INTERPRETED else (torch.float16, torch.bfloat16)


def blocks_of(qtype: Q, seed: int, n: int = N, k: int = K) -> torch.Tensor:
    """n rows of k random values' blocks."""
    return tb.random_blocks(qtype, n, k, torch.Generator().manual_seed(seed)).to(DEVICE)


@pytest.mark.parametrize("launch", LAUNCHES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_kernels_weights_are_the_dequantized_copys(qtype, dtype, launch):
    """Rows of x that pick one column each: y is that column of the matrix dequantized to x's dtype (equal values: a
    weight of -0 sums to +0), from both tiles of a block and from each of its runs, in one part of k and in several."""
    blocks = blocks_of(qtype, 2)
    tiles = BlockTiles(qtype, blocks, K, launch)
    copy = tb.Matrix(qtype, blocks, K).dequantize(dtype=dtype)
    columns = torch.tensor([0, 31, 32, 63, 64 + 5, 100, 128 + 40, 200, 256 + 200, K - 1])
    for pick in (columns[:8], columns[-8:]):
        x = torch.zeros(len(pick), K, dtype=dtype, device=DEVICE)
        x[torch.arange(len(pick)), pick] = 1
        assert torch.equal(tiles.matvec(x), copy[:, pick.to(DEVICE)].t())


@pytest.mark.parametrize("launch", LAUNCHES[:2], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_products_are_within_the_references_bound(qtype, dtype, launch):
    blocks = blocks_of(qtype, 3)
    tiles = BlockTiles(qtype, blocks, K, launch)
    x = torch.randn(tb.MATVEC_ROWS, K, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    y = tiles.matvec(x)
    assert_close(y, x, reference(qtype, blocks), gemm_tolerance(dtype))
    if not INTERPRETED:  # numpy's matmul sums a row by its place in the tile; the tensor cores do not
        for i in range(tb.MATVEC_ROWS - 1):
            assert_same_bits(tiles.matvec(x[i:i + 2]), y[i:i + 2])
        assert_same_bits(tiles.matvec(x[2:7]), y[2:7])


def test_bad_input():
    blocks = blocks_of(Q.Q4_K, 4)
    with pytest.raises(ValueError, match="uint8"):
        BlockTiles(Q.Q4_K, blocks[:, :-2], K)
    with pytest.raises(ValueError, match="uint8"):
        BlockTiles(Q.Q6_K, blocks, K)  # Q4_K's bytes
    with pytest.raises(ValueError, match="Q8_0 has no tiles"):
        BlockTiles(Q.Q8_0, blocks, K)
    with pytest.raises(ValueError, match="whole blocks"):
        BlockTiles(Q.Q4_K, blocks, K, TileLaunch(parts=3))
    tiles = BlockTiles(Q.Q4_K, blocks, K, LAUNCHES[0])
    half = torch.float16
    for bad in (torch.zeros(1, K, dtype=half), torch.zeros(9, K, dtype=half), torch.zeros(2, K - 256, dtype=half),
                torch.zeros(2, K)):  # one row, nine, another k, float32
        with pytest.raises(ValueError, match="x must be"):
            tiles.matvec(bad.to(DEVICE))
