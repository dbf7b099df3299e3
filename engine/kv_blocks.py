"""KV rows in GGML's Q8_0 blocks (`--kv q8_0`, llama.cpp's `-ctk q8_0 -ctv q8_0`): each head's row of
head_dim values as blocks of 32 int8 values and their float16 scale (34 bytes a block), 1.0625 bytes a
value against f16's 2.

A Q8_0 cache is a uint8 tensor `[sessions, kv_heads, length, row_bytes(head_dim)]`: the positions stay
its third axis, so copying, parking and restoring a session's positions move its rows as they do a
float cache's. Rows are rounded as ggml's reference quantizer rounds them (scale = max |x| / 127, each
value `roundf(x * (1 / scale))`, ties away from zero; gguf-py's `Q8_0.quantize_blocks`), and read as
scale * value in float32. The CPU's decode row (`kernels/ops_cpu.c`) stores and reads the same bits.
In torch rather than through gguf-py's numpy: every prompt chunk stores and reads its layers' rows.
"""

from __future__ import annotations

import torch

BLOCK = 32  # values a scale
BLOCK_BYTES = 2 + BLOCK  # float16 scale, then the int8 values
DTYPE = torch.uint8  # a cache of this dtype holds Q8_0 rows


def row_bytes(head_dim: int) -> int:
    if head_dim % BLOCK:
        raise ValueError(f"a Q8_0 KV cache needs head_dim a multiple of {BLOCK}, got {head_dim}")
    return head_dim // BLOCK * BLOCK_BYTES


def quantize(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (any float dtype) -> uint8 [..., row_bytes(D)]."""
    row = row_bytes(x.shape[-1])
    blocks = x.float().reshape(*x.shape[:-1], -1, BLOCK)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(scale == 0, 0.0, 1.0 / scale)
    scaled = (blocks * inverse).abs()
    whole = torch.floor(scaled)
    q = torch.sign(blocks) * (whole + torch.floor(2 * (scaled - whole)))  # C's roundf: ties away from zero, exactly
    out = torch.cat((scale.half().view(torch.uint8), q.to(torch.int8).view(torch.uint8)), dim=-1)
    return out.reshape(*x.shape[:-1], row)


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 [..., row_bytes(D)] -> [..., D] in `dtype` (float32 products, then cast)."""
    blocks = rows.reshape(*rows.shape[:-1], -1, BLOCK_BYTES)
    scale = blocks[..., :2].contiguous().view(torch.float16).float()
    q = blocks[..., 2:].contiguous().view(torch.int8).float()
    return (q * scale).reshape(*rows.shape[:-1], -1).to(dtype)


def store(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x's rows as a cache of `cache_dtype` keeps them."""
    return quantize(x) if cache_dtype == DTYPE else x.to(cache_dtype)


def load(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cached rows in `dtype`, to compute with."""
    return dequantize(rows, dtype) if rows.dtype == DTYPE else rows.to(dtype)
