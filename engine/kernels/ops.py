"""The float32 operations of a CPU decode step in C (ops_cpu.c, moe_cpu.c): RMSNorm, rope (NEOX or normal), one
query row's attention, a window's routed SwiGLU experts, argmax. engine/layers.py, engine/experts.py and
engine/sampling.py call them for CPU float32 tensors when the kernels are available (`usable`); each matches
its torch formulation to float32 rounding and computes every row on its own.
"""

from __future__ import annotations

import torch

from engine import kv_blocks
from engine.kernels import cpu

_KV_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, kv_blocks.DTYPE: 3}  # uint8: Q8_0 rows


def usable(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and x.is_cpu and cpu.available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension (x contiguous float32)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dim = x.shape[-1]
    with cpu.profiled("cpu rms_norm"):
        cpu.library().sd_rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // dim, dim, eps)
    return out


def rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """x [N, heads, dim] rotated at positions [N] (int64), tables cos/sin [context, dim / 2]; pairs
    (i, i + dim/2) when `neox`, else adjacent pairs (2i, 2i + 1), llama.cpp's normal rope."""
    x = x.contiguous()
    out = torch.empty_like(x)
    n, heads, dim = x.shape
    with cpu.profiled("cpu rope"):
        cpu.library().sd_rope(x.data_ptr(), out.data_ptr(), positions.data_ptr(), n, heads, dim,
                              cos.data_ptr(), sin.data_ptr(), int(neox))
    return out


def attend_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               lo: int, hi: int, scale: float) -> torch.Tensor:
    """One decode row: its k, v [kv_heads, dim] stored at position hi - 1 of one session's cache
    keys/values [kv_heads, ring, dim] (position p in slot p % ring, contiguous; a Q8_0 cache: uint8
    [kv_heads, ring, kv_blocks.row_bytes(dim)]), then its query q [heads, dim] over positions lo..hi-1
    -> [1, heads * dim]."""
    heads, dim = q.shape[-2:]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty(1, heads * dim)
    with cpu.profiled("cpu attend_row"):
        status = cpu.library().sd_attend_row(q.data_ptr(), k.data_ptr(), v.data_ptr(), heads, keys.shape[0], dim,
                                             keys.data_ptr(), values.data_ptr(), _KV_TYPES[keys.dtype], keys.shape[1],
                                             lo, hi, scale, out.data_ptr(), cpu.threads())
    if status != 0:
        raise MemoryError("sd_attend_row could not allocate its buffers")
    return out


def swiglu_experts(stacks: tuple[tuple[int, torch.Tensor], ...], x: torch.Tensor, ids: torch.Tensor,
                   weights: torch.Tensor) -> torch.Tensor:
    """A window's or prompt chunk's routed SwiGLU experts in one call (moe_cpu.c): x [m, hidden] float32, ids [m, k],
    weights [m, k]; `stacks` the gate, up and down stacks as (GGUF type, uint8 blocks [experts, rows,
    row_bytes] or float32 [experts, rows, cols]), each contiguous. Returns [m, hidden]: each row's k
    outputs weighted and summed in its order of choices, a row's bits whatever the window."""
    (gt, gate), (ut, up), (dt, down) = stacks
    experts, ff = gate.shape[:2]
    x = x.contiguous()
    m, hidden = x.shape
    ids = ids.to(torch.int64).contiguous()
    weights = weights.to(torch.float32).contiguous()
    out = torch.empty(m, hidden)
    with cpu.profiled("cpu swiglu_experts"):
        status = cpu.library().sd_swiglu_experts(gt, gate.data_ptr(), ut, up.data_ptr(), dt, down.data_ptr(), experts,
                                                 ff, hidden, x.data_ptr(), m, ids.shape[1], ids.data_ptr(),
                                                 weights.data_ptr(), out.data_ptr(), cpu.threads(),
                                                 cpu.activation_code())
    if status != 0:
        raise ValueError("sd_swiglu_experts refused its stacks or ids (or had no memory)")
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's first largest value's index, int64 [rows], of x [rows, n] (torch.argmax without
    its ~0.65 ms for a 262K vocabulary)."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    with cpu.profiled("cpu argmax"):
        cpu.library().sd_argmax(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
    return out
