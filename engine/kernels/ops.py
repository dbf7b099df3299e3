"""The float32 operations of a CPU decode step in C (ops_cpu.c, moe_cpu.c): RMSNorm, rope (NEOX or normal), a
decode step's attention (`attend_rows`: every row from the batch's buffers; `attend_row`: one), a window's routed
SwiGLU experts and their router, argmax, and the elementwise ones: a gated activation (SiLU or GELU-tanh of gate, times up),
residual adds (alone or with the next RMSNorm), scaling. engine/layers.py, engine/experts.py and
engine/sampling.py call them for CPU float32 tensors when the kernels are available (`usable`); each matches
its torch formulation to float32 rounding and computes every row on its own. Every call goes through
`cpu.call`, so that a decode step made of them can be recorded and replayed (engine/cpu_plans.py).
"""

from __future__ import annotations

import torch

from engine import kv_blocks
from engine.kernels import cpu

_KV_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, kv_blocks.DTYPE: 3}  # uint8: Q8_0 rows


def usable(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and x.is_cpu and cpu.available()


def _rows_in_place(x: torch.Tensor) -> torch.Tensor:
    """x, at least 2-D, itself where each row (x[i]) is contiguous, as a split product's outputs are (each
    row a slice of the product's row, `stride(0)` apart), else a contiguous copy."""
    if x.dim() == 2 and x.stride(1) == 1:  # the usual case, [rows, n] as a product gives it
        return x
    x = x if x.dim() > 1 else x[None]
    expected = 1
    for size, stride in zip(reversed(x.shape[1:]), reversed(x.stride()[1:]), strict=True):
        if size != 1 and stride != expected:
            return x.contiguous()
        expected *= size
    return x


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension (float32; rows may be strided, a new
    contiguous tensor back)."""
    out = torch.empty(x.shape)
    if x.numel() == 0:
        return out
    x = _rows_in_place(x)
    dim = x.shape[-1]
    with cpu.profiled("cpu rms_norm"):
        cpu.call("sd_rms_norm", x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), x.shape[0],
                 x.numel() // x.shape[0] // dim, dim, eps, cpu.threads())
    return out


def rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """x [N, heads, dim] (rows may be strided) rotated at positions [N] (int64), tables cos/sin
    [context, dim / 2]; pairs (i, i + dim/2) when `neox`, else adjacent pairs (2i, 2i + 1), llama.cpp's
    normal rope."""
    x = _rows_in_place(x)
    out = torch.empty(x.shape)
    n, heads, dim = x.shape
    with cpu.profiled("cpu rope"):
        cpu.call("sd_rope", x.data_ptr(), x.stride(0), out.data_ptr(), positions.data_ptr(), n, heads, dim,
                 cos.data_ptr(), sin.data_ptr(), int(neox), cpu.threads())
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
        status = cpu.call("sd_attend_row", q.data_ptr(), k.data_ptr(), v.data_ptr(), heads, keys.shape[0], dim,
                          keys.data_ptr(), values.data_ptr(), _KV_TYPES[keys.dtype], keys.shape[1], lo, hi, scale,
                          out.data_ptr(), cpu.threads())
    if status != 0:
        raise MemoryError("sd_attend_row could not allocate its buffers")
    return out


def attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                sessions: torch.Tensor, positions: torch.Tensor, window: int | None, scale: float) -> torch.Tensor:
    """A decode step's attention, row r of q [rows, heads, dim], k and v [rows, kv_heads, dim] (rows may be
    strided) as `attend_row` computes it for session sessions[r] at position positions[r] (int64 tensors: the
    batch's, read by the kernel) over the caches keys/values [sessions, kv_heads, ring, dim] (or Q8_0 rows),
    within the last `window` positions when given -> [rows, heads * dim]."""
    q, k, v = _rows_in_place(q), _rows_in_place(k), _rows_in_place(v)
    rows, heads, dim = q.shape
    out = torch.empty(rows, heads * dim)
    with cpu.profiled("cpu attend_rows"):
        status = cpu.call("sd_attend_rows", q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(),
                          v.stride(0), rows, sessions.data_ptr(), positions.data_ptr(), heads, keys.shape[1], dim,
                          keys.data_ptr(), values.data_ptr(), _KV_TYPES[keys.dtype], keys.shape[2], window or 0,
                          scale, out.data_ptr(), cpu.threads())
    if status != 0:
        raise MemoryError("sd_attend_rows could not allocate its buffers")
    return out


def swiglu_experts(stacks: tuple[tuple[int, torch.Tensor], ...], x: torch.Tensor, ids: torch.Tensor,
                   weights: torch.Tensor) -> torch.Tensor:
    """A window's or prompt chunk's routed SwiGLU experts in one call (moe_cpu.c): x [m, hidden] float32, ids [m, k],
    weights [m, k]; `stacks` the gate, up and down stacks as (GGUF type, uint8 blocks [experts, rows,
    row_bytes] or float32 [experts, rows, cols]), each contiguous (the type | `cpu.PACKED_STACK`: blocks packed
    by `cpu.pack`, each expert's rows a whole number of groups). Returns [m, hidden]: each row's k
    outputs weighted and summed in its order of choices, a row's bits whatever the window."""
    (gt, gate), (ut, up), (dt, down) = stacks
    experts, ff = gate.shape[:2]
    x = x.contiguous()
    m, hidden = x.shape
    ids = ids.to(torch.int64).contiguous()
    weights = weights.to(torch.float32).contiguous()
    out = torch.empty(m, hidden)
    with cpu.profiled("cpu swiglu_experts"):
        status = cpu.call("sd_swiglu_experts", gt, gate.data_ptr(), ut, up.data_ptr(), dt, down.data_ptr(), experts,
                          ff, hidden, x.data_ptr(), m, ids.shape[1], ids.data_ptr(), weights.data_ptr(),
                          out.data_ptr(), cpu.threads(), cpu.activation_code())
    if status != 0:
        raise ValueError("sd_swiglu_experts refused its stacks or ids (or had no memory)")
    return out


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A MoE router in one call (moe_cpu.c): softmax(x [m, hidden] @ router [experts, hidden]^T) per row, its top_k
    (the first on ties) -> weights [m, top_k] float32 (divided by their sum when `normalize`), ids [m, top_k] int64."""
    x, router = x.contiguous(), router.contiguous()
    m, hidden = x.shape
    weights, ids = torch.empty(m, top_k), torch.empty(m, top_k, dtype=torch.int64)
    with cpu.profiled("cpu route"):
        status = cpu.call("sd_route", x.data_ptr(), m, hidden, router.data_ptr(), router.shape[0], top_k,
                          int(normalize), weights.data_ptr(), ids.data_ptr(), cpu.threads())
    if status != 0:
        raise ValueError(f"sd_route refused top_k={top_k} of {router.shape[0]} experts (or met NaN logits)")
    return weights, ids


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's first largest value's index, int64 [rows], of x [rows, n] (torch.argmax without
    its ~0.65 ms for a 262K vocabulary)."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    with cpu.profiled("cpu argmax"):
        cpu.call("sd_argmax", x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
    return out


_GATED = {"silu": 0, "gelu_tanh": 1}  # sd_gated's kinds


def gated(kind: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up, act "silu" or "gelu_tanh" (F.gelu(approximate="tanh")), each computed as x / (1 + exp(.)),
    not torch's bits: act within 2e-6 relative (1e-7 absolute near 0) of its float64 value. gate and up of one
    shape, [rows, n] whose rows may be strided (the halves of a split product) -> a new contiguous tensor."""
    code = _GATED[kind]
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    if gate.numel() == 0:
        return torch.empty(*gate.shape)
    shape = gate.shape
    gate, up = _rows_in_place(gate), _rows_in_place(up)
    rows = gate.shape[0]
    n = gate.numel() // rows
    out = torch.empty(rows, n)
    with cpu.profiled(f"cpu gated {kind}"):
        cpu.call("sd_gated", code, gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), out.data_ptr(), rows, n)
    return out if len(shape) == 2 else out.view(shape)


def add(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """x + r, of one shape (the bits of torch's x + r) -> a new contiguous tensor."""
    if x.shape != r.shape:
        raise ValueError(f"x {tuple(x.shape)} and r {tuple(r.shape)} differ")
    x, r = x.contiguous(), r.contiguous()
    out = torch.empty_like(x)  # 0.6 us, torch.empty(x.shape) 1.6
    with cpu.profiled("cpu add"):
        cpu.call("sd_add", x.data_ptr(), r.data_ptr(), out.data_ptr(), x.numel())
    return out


def add_rms_norm(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + r, rms_norm(x + r, weight, eps)) over the last dimension, in one call: the bits of `add` and `rms_norm`."""
    if x.shape != r.shape:
        raise ValueError(f"x {tuple(x.shape)} and r {tuple(r.shape)} differ")
    x, r = x.contiguous(), r.contiguous()
    total, normed = torch.empty_like(x), torch.empty_like(x)
    dim = x.shape[-1]
    if x.numel() == 0:
        return total, normed
    with cpu.profiled("cpu add_rms_norm"):
        cpu.call("sd_add_rms_norm", x.data_ptr(), r.data_ptr(), weight.data_ptr(), total.data_ptr(), normed.data_ptr(),
                 x.numel() // dim, dim, eps, cpu.threads())
    return total, normed


def scale(x: torch.Tensor, s: float) -> torch.Tensor:
    """x * s, s rounded to float32 (the bits of x * torch.tensor(s)) -> a new contiguous tensor."""
    x = x.contiguous()
    out = torch.empty_like(x)
    with cpu.profiled("cpu scale"):
        cpu.call("sd_scale", x.data_ptr(), s, out.data_ptr(), x.numel())
    return out
