"""Tensor data from a GGUF file as torch tensors: the float types directly, block quants dequantized.

Block quants go through gguf-py's numpy dequantizers (the reference implementation of every ggml
type); the float types are reinterpreted without a copy through numpy.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from engine.gguf_file import GGUFError, GGUFFile

# Types the demo and common files use; gguf-py can dequantize more, but these are the ones tested.
SUPPORTED = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)


def check_supported(gguf: GGUFFile) -> None:
    """Refuse a file with a tensor type we cannot dequantize, naming tensor and type."""
    for info in gguf.tensors.values():
        if info.qtype not in SUPPORTED:
            names = ", ".join(t.name for t in SUPPORTED)
            raise GGUFError(f"{gguf.path}: tensor {info.name} has type {info.qtype.name}, not supported (supported: {names})")


def load_tensor(gguf: GGUFFile, name: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """One tensor in `dtype` on `device`, shaped like torch (slowest dimension first)."""
    info = gguf.tensors.get(name)
    if info is None:
        raise GGUFError(f"{gguf.path}: missing tensor {name!r}")
    raw = gguf.tensor_data(name)
    if info.qtype == Q.BF16:
        host = torch.from_numpy(np.array(raw).view(np.int16)).view(torch.bfloat16).reshape(info.shape)
    elif info.qtype in (Q.F32, Q.F16):
        host = torch.from_numpy(np.array(raw))
    else:
        host = torch.from_numpy(quants.dequantize(np.asarray(raw), info.qtype)).reshape(info.shape)
    return host.to(device=device, dtype=dtype)
