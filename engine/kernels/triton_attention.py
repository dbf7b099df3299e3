"""Decode attention in one Triton launch: every row of a decode window (one query per session) against its
own session's cached keys and values, read in place from the KV cache.

One program per (row, KV head): it reads the row's session and position, walks the positions the row
sees (`lo..pos`, the last `window` of them on a sliding layer; position p in ring slot p % ring) in
blocks of `BLOCK_L` keys, and keeps an online softmax for the query heads that share the KV head (GQA:
query head h reads KV head h // n_rep). So nothing is gathered, padded or repeated per query head, and
a row's result depends only on its own query and keys: the same bits alone or beside any other rows,
at any length of the others (a padded attention call is not: its reductions follow the longest row).

Scores in float32 (`tl.dot`, exact float32 products for float32 inputs), probabilities cast to the
values' dtype for the second product, as flash attention does; the output in q's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_L = 64  # keys per step: fixed, so a row's reduction order depends on its own length only


@triton.jit
def _decode_kernel(q, k_cache, v_cache, out, sessions, positions, scale, ring, window,
                   stride_s, stride_h, N_REP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr,
                   BLOCK_L: tl.constexpr, PRECISION: tl.constexpr):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    heads = tl.num_programs(1) * N_REP
    session = tl.load(sessions + row).to(tl.int64)
    pos = tl.load(positions + row)
    lo = tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    live_h = h < N_REP
    q_at = q + (row * heads + kv_head * N_REP + h).to(tl.int64)[:, None] * D + d[None, :]
    qh = tl.load(q_at, mask=live_h[:, None], other=0.0).to(k_cache.dtype.element_ty)
    base = session * stride_s + kv_head * stride_h
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, D), tl.float32)
    for start in range(lo, pos + 1, BLOCK_L):
        p = start + tl.arange(0, BLOCK_L)
        seen = p <= pos
        at = base + (p % ring).to(tl.int64)[:, None] * D + d[None, :]
        keys = tl.load(k_cache + at, mask=seen[:, None], other=0.0)
        scores = tl.dot(qh, tl.trans(keys), input_precision=PRECISION) * scale
        scores = tl.where(seen[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        kept = tl.exp(m - m_new)
        probs = tl.exp(scores - m_new[:, None])
        total = total * kept + tl.sum(probs, axis=1)
        values = tl.load(v_cache + at, mask=seen[:, None], other=0.0)
        acc = acc * kept[:, None] + tl.dot(probs.to(values.dtype), values, input_precision=PRECISION)
        m = m_new
    o = acc / total[:, None]
    o_at = out + (row * heads + kv_head * N_REP + h).to(tl.int64)[:, None] * D + d[None, :]
    tl.store(o_at, o.to(out.dtype.element_ty), mask=live_h[:, None])


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, sessions: torch.Tensor,
                     positions: torch.Tensor, scale: float, window: int | None = None) -> torch.Tensor:
    """q [N, Hq, D] (row i is session `sessions[i]`'s query at `positions[i]`, whose key and value are
    already in the caches); caches [sessions, Hkv, ring, D]. Returns [N, Hq * D] in q's dtype."""
    n, heads, dim = q.shape
    kv_heads, ring = k_cache.shape[1], k_cache.shape[2]
    if heads % kv_heads or dim & (dim - 1) or dim < 16:
        raise ValueError(f"{heads} query heads over {kv_heads} KV heads of {dim} (a power of two >= 16)")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape):
        raise ValueError("the K and V caches must be contiguous and of one shape")
    q = q.contiguous()
    out = torch.empty(n, heads * dim, dtype=q.dtype, device=q.device)
    n_rep = heads // kv_heads
    precision = "ieee" if k_cache.dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs
    _decode_kernel[(n, kv_heads)](q, k_cache, v_cache, out, sessions, positions, scale, ring, window or 0,
                                  k_cache.stride(0), k_cache.stride(1), N_REP=n_rep,
                                  BLOCK_H=max(16, triton.next_power_of_2(n_rep)), D=dim, BLOCK_L=BLOCK_L,
                                  PRECISION=precision)
    return out
