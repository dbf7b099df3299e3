"""Decode attention in two Triton launches: every row of a decode window (one query per session) against its
own session's cached keys and values, read in place from the KV cache.

The positions a row sees (`lo..pos`, the last `window` of them on a sliding layer; position p in ring slot
p % ring) are cut into chunks of `CHUNK` keys counted from `lo`. The first launch runs programs per
(row, KV head, split); each takes chunks split, split + splits, ... of its row and, for the query heads
that share the KV head (GQA: query head h reads KV head h // n_rep), writes each chunk's running max,
softmax total and weighted values (an online softmax over blocks of `BLOCK_L` keys). The second launch
merges a row's chunks in chunk order. The program that takes a row's last chunk first writes the row's
own key and value into the cache (no launch of its own). So nothing is gathered, padded or repeated per query head, a long
row is spread over many programs (flash decoding), and a row's result depends only on its own query and
keys: the chunks and their merge follow its own length, whichever program computed them, so a row has
the same bits alone or beside any other rows, at any length of the others.

Scores in float32 (`tl.dot`, exact float32 products for float32 inputs), probabilities cast to the
values' dtype for the second product, as flash attention does; the output in q's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import pdl
from engine.kernels.triton_blocks import MATVEC_ROWS
from engine.kernels.triton_rows import rows_of_heads
from engine.kernels.triton_xq import GROUP, RoundedRows, round_groups

BLOCK_L = 64  # keys per step: fixed, so a row's reduction order depends on its own length only
CHUNK = BLOCK_L  # keys per partial result: one step a program (128 keys, two steps: 7.1 us a one-row call)
MERGE = 16  # chunks merged per step
PROGRAMS = 512  # (row, KV head, split) programs a launch aims at: a few per SM; does not change results


@triton.jit
def _first_seen(pos, window):
    return tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0)


@triton.jit
def _chunks_kernel(q, k, v, k_cache, v_cache, part_max, part_total, part_acc, sessions, positions, scale, ring, window,
                   chunks, stride_s, stride_h, stride_k, stride_v, N_REP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr,
                   BLOCK_L: tl.constexpr, CHUNK: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    heads = tl.num_programs(1) * N_REP
    session = tl.load(sessions + row).to(tl.int64)
    pos = tl.load(positions + row)
    lo = _first_seen(pos, window)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    live_h = h < N_REP
    head = (row * heads + kv_head * N_REP + h).to(tl.int64)
    qh = tl.load(q + head[:, None] * D + d[None, :], mask=live_h[:, None], other=0.0).to(k_cache.dtype.element_ty)
    base = session * stride_s + kv_head * stride_h
    if tl.program_id(2) == ((pos - lo) // CHUNK) % tl.num_programs(2):  # the program of the row's last chunk
        new = kv_head.to(tl.int64) * D + d  # writes the row's key and value first
        slot = base + (pos % ring).to(tl.int64) * D + d
        tl.store(k_cache + slot, tl.load(k + row.to(tl.int64) * stride_k + new).to(k_cache.dtype.element_ty))
        tl.store(v_cache + slot, tl.load(v + row.to(tl.int64) * stride_v + new).to(v_cache.dtype.element_ty))
        tl.debug_barrier()  # then its threads read them back among the chunk's keys
    for c in range(tl.program_id(2), tl.cdiv(pos - lo + 1, CHUNK), tl.num_programs(2)):
        m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
        total = tl.zeros((BLOCK_H,), tl.float32)
        acc = tl.zeros((BLOCK_H, D), tl.float32)
        for start in range(lo + c * CHUNK, tl.minimum(lo + (c + 1) * CHUNK, pos + 1), BLOCK_L):
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
        at = head * chunks + c
        tl.store(part_max + at, m, mask=live_h)
        tl.store(part_total + at, total, mask=live_h)
        tl.store(part_acc + at[:, None] * D + d[None, :], acc, mask=live_h[:, None])


@triton.jit
def _merge_kernel(part_max, part_total, part_acc, out, q, scale, sums, halves, hi, lo, positions, window, chunks,
                  D: tl.constexpr, CHUNK: tl.constexpr, MERGE: tl.constexpr, ROUND: tl.constexpr, PLANES: tl.constexpr,
                  PDL: tl.constexpr):
    pdl.wait(PDL)
    row = tl.program_id(0)
    head = (row * tl.num_programs(1) + tl.program_id(1)).to(tl.int64)
    pos = tl.load(positions + row)
    n = tl.cdiv(pos - _first_seen(pos, window) + 1, CHUNK)
    c = tl.arange(0, MERGE)
    d = tl.arange(0, D)
    m = tl.full((MERGE,), float("-inf"), tl.float32)
    for first in range(0, n, MERGE):
        m = tl.maximum(m, tl.load(part_max + head * chunks + first + c, mask=first + c < n, other=float("-inf")))
    top = tl.max(m, axis=0)
    total = tl.zeros((MERGE,), tl.float32)
    acc = tl.zeros((D,), tl.float32)
    for first in range(0, n, MERGE):
        live = first + c < n
        at = head * chunks + first + c
        w = tl.where(live, tl.exp(tl.load(part_max + at, mask=live, other=0.0) - top), 0.0)
        total += w * tl.load(part_total + at, mask=live, other=0.0)
        acc += tl.sum(w[:, None] * tl.load(part_acc + at[:, None] * D + d[None, :], mask=live[:, None], other=0.0),
                      axis=0)
    merged = (acc / tl.sum(total, axis=0)).to(out.dtype.element_ty)
    tl.store(out + head * D + d, merged)
    if ROUND:  # the row rounded for attn_output's int16 product, this head's groups of it
        g = tl.program_id(1) * (D // 32) + tl.arange(0, D // 32)[:, None]
        round_groups(tl.reshape(merged.to(tl.float32), (D // 32, 32)), g, g >= 0, q, scale, sums, halves, hi, lo,
                     row.to(tl.int64), tl.num_programs(1) * D, D // 32, PLANES)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     sessions: torch.Tensor, positions: torch.Tensor, scale: float, window: int | None = None
                     ) -> torch.Tensor:
    """q [N, Hq, D] (row i is session `sessions[i]`'s query at `positions[i]`), the rows' keys and values k, v
    [N, Hkv, D], written into ring slot position % ring of each row's session in the caches' dtype first
    (by the program that reads that chunk); caches [sessions, Hkv, ring, D]. Returns [N, Hq * D] in q's
    dtype."""
    n, heads, dim = q.shape
    kv_heads, ring = k_cache.shape[1], k_cache.shape[2]
    if heads % kv_heads or dim & (dim - 1) or dim < 16:
        raise ValueError(f"{heads} query heads over {kv_heads} KV heads of {dim} (a power of two >= 16)")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape):
        raise ValueError("the K and V caches must be contiguous and of one shape")
    if k.shape != (n, kv_heads, dim) or v.shape != k.shape:
        raise ValueError(f"k, v [{n}, {kv_heads}, {dim}] for these caches, got {tuple(k.shape)} and {tuple(v.shape)}")
    q, k, v = q.contiguous(), rows_of_heads(k), rows_of_heads(v)
    chunks = triton.cdiv(ring, CHUNK)  # the most a row can have: its positions fit in the ring
    part_max = torch.empty(n, heads, chunks, dtype=torch.float32, device=q.device)
    part_total = torch.empty_like(part_max)
    part_acc = torch.empty(n, heads, chunks, dim, dtype=torch.float32, device=q.device)
    n_rep = heads // kv_heads
    splits = max(1, min(chunks, PROGRAMS // (n * kv_heads)))
    precision = "ieee" if k_cache.dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs
    _chunks_kernel[(n, kv_heads, splits)](q, k, v, k_cache, v_cache, part_max, part_total, part_acc, sessions, positions,
                                          scale, ring, window or 0, chunks, k_cache.stride(0), k_cache.stride(1),
                                          k.stride(0), v.stride(0),
                                          N_REP=n_rep, BLOCK_H=max(16, triton.next_power_of_2(n_rep)), D=dim,
                                          BLOCK_L=BLOCK_L, CHUNK=CHUNK, PRECISION=precision,
                                          **pdl.launch(q.device))
    out = torch.empty(n, heads * dim, dtype=q.dtype, device=q.device)
    rounds = n <= MATVEC_ROWS and dim % GROUP == 0 and RoundedRows.wanted(q.device)
    rounded = RoundedRows.for_window(n, heads * dim, q.device) if rounds else None
    rounding, flags = RoundedRows.kernel_args(rounded, out)
    _merge_kernel[(n, heads)](part_max, part_total, part_acc, out, *rounding, positions, window or 0, chunks, D=dim,
                              CHUNK=CHUNK, MERGE=MERGE, **flags, **pdl.launch(q.device))
    if rounded is not None:
        rounded.remember(out)
    return out
