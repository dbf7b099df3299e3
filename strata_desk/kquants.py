"""Q4_K and Q6_K blocks from float32 values, in numpy, for the generated test model (gguf-py reads these
types but cannot write them).

A plain quantizer, not llama.cpp's search for the best scales: each group's range sets its scale (and,
in Q4_K, its min), rounded to the 6- or 8-bit sub-scales of the super-block. The bytes follow ggml's
layout exactly, so gguf-py's dequantizer (and every kernel) reads back values within a quantization step
of the input.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

QK_K = 256


def _super_blocks(x: np.ndarray, qtype: QT) -> np.ndarray:
    if x.dtype != np.float32 or x.shape[-1] % QK_K:
        raise ValueError(f"{qtype.name} needs float32 rows of a multiple of {QK_K} values, got {x.dtype} {x.shape}")
    return x.reshape(-1, QK_K)


def _f16(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """v rounded to float16: its bytes [n, 2] and its value as float32 [n, 1]."""
    half = v.astype(np.float16)
    return half.view(np.uint8).reshape(-1, 2), half.astype(np.float32)[:, None]


def _per(step: np.ndarray) -> np.ndarray:
    """1 / step, 0 where the step is 0 (groups of zeros): values times it count steps."""
    return np.divide(1, step, out=np.zeros_like(step), where=step != 0)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """Q4_K blocks of x (float32 [..., k], k a multiple of 256) as uint8 [..., k / 256 * 144]."""
    blocks = _super_blocks(x, QT.Q4_K).reshape(-1, 8, 32)
    low = np.minimum(blocks.min(axis=2), 0)
    scale = (blocks.max(axis=2) - low) / 15  # w = q * scale - min, q in 0..15, min = -low >= 0
    d_bytes, d = _f16(scale.max(axis=1) / 63)
    dmin_bytes, dmin = _f16(-low.min(axis=1) / 63)
    sc = np.clip(np.rint(scale * _per(d)), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(-low * _per(dmin)), 0, 63).astype(np.uint8)
    q = (blocks + (dmin * mn)[:, :, None]) * _per(d * sc)[:, :, None]
    q = np.clip(np.rint(q, out=q), 0, 15, out=q).astype(np.uint8)
    packed = np.concatenate([  # 6-bit scales and mins: 4 + 4 in the low bits, the last 4 split
        sc[:, :4] | (sc[:, 4:] >> 4 << 6), mn[:, :4] | (mn[:, 4:] >> 4 << 6), (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    ], axis=1)
    nibbles = q.reshape(-1, 4, 2, 32)  # groups 2j and 2j+1 share 32 bytes: low and high nibbles
    qs = (nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)).reshape(-1, 128)
    out = np.concatenate([d_bytes, dmin_bytes, packed, qs], axis=1)
    return out.reshape(*x.shape[:-1], x.shape[-1] // QK_K * GGML_QUANT_SIZES[QT.Q4_K][1])


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Q6_K blocks of x (float32 [..., k], k a multiple of 256) as uint8 [..., k / 256 * 210]."""
    blocks = _super_blocks(x, QT.Q6_K).reshape(-1, 16, 16)
    scale = np.abs(blocks).max(axis=2) / 31  # w = q * scale, q in -32..31
    d_bytes, d = _f16(scale.max(axis=1) / 127)
    sc = np.clip(np.rint(scale * _per(d)), 0, 127).astype(np.int8)
    q = blocks * _per(d * sc)[:, :, None]
    # two halves of 128 values, 4 x 32 each: a byte holds the low nibbles of 2, the high bits of 4
    q = (np.clip(np.rint(q, out=q), -32, 31, out=q) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)
    low, high = q & 15, q >> 4
    ql = (low[:, :, 0:2] | (low[:, :, 2:4] << 4)).reshape(-1, 128)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(-1, 64)
    out = np.concatenate([ql, qh, sc.view(np.uint8), d_bytes], axis=1)
    return out.reshape(*x.shape[:-1], x.shape[-1] // QK_K * GGML_QUANT_SIZES[QT.Q6_K][1])


QUANTIZERS = {QT.Q4_K: quantize_q4_k, QT.Q6_K: quantize_q6_k}
