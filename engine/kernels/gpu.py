"""What the format policy asks before keeping GGUF blocks on CUDA, without importing Triton itself
(the kernels are in `triton_blocks`, imported only once a CUDA store keeps a matrix's blocks)."""

from __future__ import annotations

import functools

import torch
from gguf import GGMLQuantizationType as Q

SUPPORTED = (Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)
# 16-bit float "blocks" (a value each, no scale): expert stacks of these types stay as they are for the
# fused MoE kernel; dense F16/BF16 matrices become torch's (cuBLAS), so these are not in SUPPORTED
FLOAT_BLOCKS = (Q.F16, Q.BF16)
FLOAT_DTYPE = {Q.F16: torch.float16, Q.BF16: torch.bfloat16}  # the torch dtype of their values
MATVEC_ROWS = 8  # rows of x one matvec call takes (a decode window); more rows: the GEMM


@functools.cache
def unavailable_reason() -> str | None:
    """Why the Triton kernels cannot run here (Triton missing or broken, a GPU before Ampere), else None."""
    try:
        import triton  # noqa: F401
    except Exception as exc:  # a broken install raises more than ImportError
        return f"triton is not importable: {exc}"
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 0):
        return "the bf16 tiles of the prompt GEMM need compute capability 8.0 or newer"
    return None


def available() -> bool:
    return unavailable_reason() is None
