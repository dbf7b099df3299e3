"""What the Triton kernel tests (tests/test_triton_kernels.py in the interpreter, tests/test_triton_gpu.py
on CUDA) check against: gguf-py's values, error bounds, bit equality."""

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

ACCUMULATION = 4e-5  # float32 sums over k, relative to sum |x w|
# One unit in the last place of y's dtype (the interpreter truncates to bf16, the GPU rounds to nearest).
OUTPUT_ULP = {torch.float32: 0.0, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
# W and x rounded into GEMM tiles of x's dtype (float32 tiles: tf32 on the GPU's tensor cores).
TILE_ULP = {torch.float32: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def reference(qtype: GGMLQuantizationType, blocks: torch.Tensor) -> torch.Tensor:
    """gguf-py's float32 values of the blocks, on their device."""
    values = np.asarray(quants.dequantize(blocks.cpu().numpy(), qtype), dtype=np.float32)
    return torch.from_numpy(values.reshape(blocks.shape[0], -1)).to(blocks.device)


def matvec_tolerance(dtype: torch.dtype) -> float:
    return ACCUMULATION + OUTPUT_ULP[dtype]


def gemm_tolerance(dtype: torch.dtype) -> float:
    return ACCUMULATION + 2 * TILE_ULP[dtype] + OUTPUT_ULP[dtype]


def assert_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, tolerance: float) -> None:
    """y in x's dtype, and |y - x @ w.T| within `tolerance` of sum |x w| (float64 reference)."""
    exact = x.double() @ w.double().T
    bound = tolerance * (x.double().abs() @ w.double().abs().T)
    assert y.dtype == x.dtype and y.shape == exact.shape
    excess = (y.double() - exact).abs() - bound
    assert (excess <= 0).all(), f"worst error {excess.max().item():.3g} over the bound"


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    bits = torch.int16 if a.element_size() == 2 else torch.int32
    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(bits), b.view(bits))
