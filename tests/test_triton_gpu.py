"""The Triton block kernels compiled on CUDA at real shapes (marker `gpu`; skipped without a GPU): every
type against gguf-py's dequantizer and the float64 product of its values, rows bit-identical whatever
the number of rows; a Q8_0 model keeps its blocks on the GPU and batch = solo."""

import pytest
import torch
from gguf import GGMLQuantizationType as Q

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():  # before the kernels are imported: elsewhere they run interpreted
    pytest.skip("needs CUDA", allow_module_level=True)

from triton_checks import (  # noqa: E402
    assert_close,
    assert_same_bits,
    gemm_tolerance,
    matvec_tolerance,
    reference,
    rounding_error,
)

from engine.check import Driver, compare, sample_prompts  # noqa: E402
from engine.kernels import gpu  # noqa: E402
from engine.kernels import triton_blocks as tb  # noqa: E402

SHAPES = ((2048, 768), (768, 2048))  # an expert's up and down projections in qwen3-30b-a3b


@pytest.fixture(scope="module", params=[(q, n, k) for q in gpu.SUPPORTED for n, k in SHAPES],
                ids=lambda p: f"{p[0].name}-{p[1]}x{p[2]}")
def case(request: pytest.FixtureRequest) -> tuple[tb.Matrix, torch.Tensor]:
    """A matrix of random blocks (its tiles chosen by its shape) and gguf-py's values of it."""
    qtype, n, k = request.param
    blocks = tb.random_blocks(qtype, n, k, torch.Generator().manual_seed(n + int(qtype))).cuda()
    return tb.Matrix(qtype, blocks, k), reference(qtype, blocks)


def random_x(m: int, k: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to("cuda", dtype)


def test_dequantize_matches_gguf_py(case):
    mat, ref = case
    assert_same_bits(mat.dequantize(), ref)
    assert_same_bits(mat.dequantize(dtype=torch.bfloat16), ref.bfloat16())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("m", [1, 4, 8, 64])
def test_product_matches_reference(case, m, dtype):
    mat, ref = case
    x = random_x(m, mat.k, dtype)
    matvec = m == 1 or (m <= tb.MATVEC_ROWS and mat.qtype in tb.ROUNDED)  # else the GEMM's tiles
    tolerance = matvec_tolerance(dtype) if matvec else gemm_tolerance(dtype)
    rounded = rounding_error(x) if m <= tb.MATVEC_ROWS and mat.qtype in tb.ROUNDED else None  # x in int16
    assert_close(mat.matmul(x), x, ref, tolerance, rounded)


def test_rows_do_not_depend_on_m(case):
    mat, _ = case
    x = random_x(64, mat.k, torch.bfloat16, seed=2)
    window = mat.matmul(x[:tb.MATVEC_ROWS])
    for i in range(tb.MATVEC_ROWS - 1):  # 2-8 rows share each row's bits; one row is a kernel of its own
        assert_same_bits(mat.matmul(x[i:i + 2]), window[i:i + 2])
    assert_same_bits(mat.matmul(x[3:7]), window[3:7])
    assert_same_bits(mat.matmul(x[5:6]), mat.matmul(x[5:6].clone()))
    chunk = mat.matmul(x)
    assert_same_bits(mat.matmul(x[5:30]), chunk[5:30])  # other rows, other places in the GEMM's tiles


def test_q6_k_head_one_row_matches_reference():
    """A Q6_K head (32,768 rows and more) has one-row tiles of its own."""
    n, k = 32768, 2048
    blocks = tb.random_blocks(Q.Q6_K, n, k, torch.Generator().manual_seed(3)).cuda()
    mat = tb.Matrix(Q.Q6_K, blocks, k)
    assert mat._one_row == (4, 1, 1)
    x = random_x(1, k, torch.bfloat16)
    assert_close(mat.matmul(x), x, reference(Q.Q6_K, blocks), matvec_tolerance(torch.bfloat16),
                 rounding_error(x))


def test_q8_model_keeps_blocks_and_batch_equals_solo(tiny_model_q8):
    driver = Driver.load(str(tiny_model_q8), slots=8, device="cuda")
    assert "Q8_0 blocks" in driver.model.w.describe()
    prompts = sample_prompts(driver.model.hyper.vocab, 8, seed=5)
    assert compare(driver, prompts, max_new=24) == []
