"""`--kv q8_0`'s rows (engine/kv_blocks.py) against gguf-py's Q8_0 quantizer and dequantizer, bit for bit."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from engine import kv_blocks
from engine.kv import KVCache, kv_name


def test_rows_are_gguf_py_q8_0_blocks():
    x = torch.randn(3, 5, 128, generator=torch.Generator().manual_seed(0)) * torch.logspace(-4, 4, 5)[None, :, None]
    x[0, 0, :32] = 0  # a zero block: scale 0, values 0
    x[0, 1, :32] = torch.arange(-16, 16) * 0.5  # ties: scale 8 / 127, ...
    x[0, 2, :32] = torch.tensor([127.0, 63.5, -0.5, 1.5, -2.5] + [0.0] * 27)  # scale 1: x.5 ties away from zero
    rows = kv_blocks.quantize(x)
    want = quants.quantize(x.numpy().reshape(-1, 128), Q.Q8_0)
    assert rows.shape == (3, 5, kv_blocks.row_bytes(128)) and rows.dtype == torch.uint8
    assert np.array_equal(rows.reshape(-1, rows.shape[-1]).numpy(), want)
    back = kv_blocks.dequantize(rows, torch.float32)
    assert np.array_equal(back.reshape(-1, 128).numpy(), quants.dequantize(want, Q.Q8_0))
    assert torch.equal(kv_blocks.load(kv_blocks.store(x, torch.float16), torch.float32), x.half().float())


def test_a_q8_0_cache_holds_rows_of_blocks():
    cache = KVCache((None, 8), sessions=2, kv_heads=2, context=64, head_dim=64, max_chunk=8, dtype=kv_blocks.DTYPE,
                    device=torch.device("cpu"))
    assert cache.k[0].shape == (2, 2, 64, 68) and cache.k[1].shape == (2, 2, 16, 68)
    assert cache.session_bytes() == KVCache.bytes_per_session((None, 8), 2, 64, 64, 8, kv_blocks.DTYPE)
    assert cache.session_bytes() == 2 * (64 + 16) * 2 * 68
    assert kv_name(cache.k[0].dtype) == "q8_0" and kv_name(torch.float16) == "float16"
    with pytest.raises(ValueError, match="multiple of 32"):
        kv_blocks.row_bytes(48)


def test_a_gpu_refuses_a_q8_0_cache():
    """The GPU's attention kernel reads float caches: `--kv q8_0` there is a clear error at start."""
    from engine.loading import pick_kv_dtype

    with pytest.raises(ValueError, match="CPU only"):
        pick_kv_dtype("q8_0", torch.device("cuda"), torch.bfloat16)
    assert pick_kv_dtype("q8_0", torch.device("cpu"), torch.float32) == kv_blocks.DTYPE
