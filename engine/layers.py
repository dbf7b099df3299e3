"""Building blocks shared by the architectures: norms, rotary embedding, attention over sessions, MoE.

Every function takes the rows of a window flattened to `[N, ...]`; `Span`s say which rows belong to
which session and where. A prompt chunk is one span of many rows; a decode window is one span of
one row per session. All arithmetic on a row depends only on that row (and its session's cache),
except the matrix products that mix the rows of one call: that is why exact mode runs decode rows
one call each (engine/runner.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

ATTEND_BUCKET = 256


@dataclass(frozen=True)
class Span:
    """`length` consecutive rows of the window that feed `session` from position `start`."""

    session: int
    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class Window:
    """The rows of one forward pass and their device-side indices, built with one host copy (a copy
    per layer would make every layer wait for the GPU)."""

    spans: list[Span]
    positions: torch.Tensor  # [N] position of every row
    last: torch.Tensor  # [len(spans)] index of each span's last row
    sessions: torch.Tensor  # [len(spans)] session of each span

    @classmethod
    def of(cls, spans: list[Span], device: torch.device) -> Window:
        positions = [p for s in spans for p in range(s.start, s.end)]
        ends, total = [], 0
        for s in spans:
            total += s.length
            ends.append(total - 1)
        packed = torch.tensor(positions + ends + [s.session for s in spans]).to(device)
        n, r = len(positions), len(spans)
        return cls(spans, packed[:n], packed[n : n + r], packed[n + r :])

    @property
    def single_rows(self) -> bool:
        """A decode window of several sessions, one row each."""
        return len(self.spans) > 1 and all(s.length == 1 for s in self.spans)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


class Rope:
    """NEOX-style rotary embedding (rotate halves), tables precomputed for the whole context."""

    def __init__(self, head_dim: int, base: float, context: int, device: torch.device):
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        angles = torch.arange(context, dtype=torch.float64)[:, None] * inv_freq[None, :]
        self.cos = angles.cos().float().to(device)
        self.sin = angles.sin().float().to(device)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [N, heads, head_dim]; positions: [N]."""
        cos = self.cos[positions][:, None, :]
        sin = self.sin[positions][:, None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: Window,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Write the rows' k/v into their sessions' caches, then attend each span over its session.

    q: [N, Hq, D]; k, v: [N, Hkv, D]; caches: [sessions, Hkv, context, D]. Returns [N, Hq * D].
    `window` limits each query to the last `window` positions (sliding-window layers).
    """
    if rows.single_rows:
        return _attend_rows(q, k, v, k_cache, v_cache, rows, scale, window)
    out = []
    row = 0
    n_rep = q.shape[1] // k.shape[1]
    for span in rows.spans:
        rows = slice(row, row + span.length)
        k_cache[span.session, :, span.start : span.end] = k[rows].transpose(0, 1)
        v_cache[span.session, :, span.start : span.end] = v[rows].transpose(0, 1)
        lo = 0 if window is None else max(0, span.start - window + 1)
        keys = k_cache[span.session, :, lo : span.end].repeat_interleave(n_rep, dim=0)
        values = v_cache[span.session, :, lo : span.end].repeat_interleave(n_rep, dim=0)
        q_pos = torch.arange(span.start, span.end, device=q.device)[:, None]
        k_pos = torch.arange(lo, span.end, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= q_pos - k_pos < window
        o = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1), keys, values, attn_mask=mask, scale=scale
        )  # [Hq, T, D]
        out.append(o.transpose(0, 1).reshape(span.length, -1))
        row += span.length
    return torch.cat(out, dim=0)


def _attend_rows(q, k, v, k_cache, v_cache, rows: Window, scale: float, window: int | None) -> torch.Tensor:
    """A decode window (one row per session) in one attention call over the sessions' caches,
    padded to the longest and masked per row. Its reductions depend on the other rows' lengths,
    which is why exact mode never comes here (it runs rows one at a time)."""
    spans, sessions, pos = rows.spans, rows.sessions, rows.positions
    k_cache[sessions, :, pos] = k
    v_cache[sessions, :, pos] = v
    # padded to a multiple of ATTEND_BUCKET: the attention kernels then see a handful of shapes
    # instead of a new one every step (cuDNN plans a kernel per shape, ~3 ms of CPU each)
    length = min(-(-max(s.end for s in spans) // ATTEND_BUCKET) * ATTEND_BUCKET, k_cache.shape[2])
    n_rep = q.shape[1] // k.shape[1]
    keys = k_cache[sessions, :, :length].repeat_interleave(n_rep, dim=1)  # [R, Hq, L, D]
    values = v_cache[sessions, :, :length].repeat_interleave(n_rep, dim=1)
    k_pos = torch.arange(length, device=q.device)[None, :]
    mask = k_pos <= pos[:, None]
    if window is not None:
        mask &= pos[:, None] - k_pos < window
    o = F.scaled_dot_product_attention(q[:, :, None, :], keys, values, attn_mask=mask[:, None, None, :], scale=scale)
    return o.reshape(len(spans), -1)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax router then top-k (Qwen3-MoE order). Returns weights [N, k] (float32) and ids [N, k]."""
    probs = torch.softmax(F.linear(x.float(), router.float()), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_swiglu(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_exps: torch.Tensor,
    up_exps: torch.Tensor,
    down_exps: torch.Tensor,
) -> torch.Tensor:
    """Routed SwiGLU experts. x: [N, H]; gate/up: [E, F, H]; down: [E, H, F].

    Rows routed to the same expert are computed together, so each routed expert's weights are
    read once per call. On CUDA a single row gathers its experts instead: that path has no host
    sync, so a decode step can be captured in a CUDA graph later.
    """
    if x.is_cuda and x.shape[0] == 1:
        g = torch.einsum("nh,nkfh->nkf", x, gate_exps[ids])
        u = torch.einsum("nh,nkfh->nkf", x, up_exps[ids])
        y = torch.einsum("nkf,nkhf->nkh", F.silu(g) * u, down_exps[ids])
        return (y.float() * weights[..., None]).sum(dim=1).to(x.dtype)
    if x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        return _moe_grouped(x, weights, ids, gate_exps, up_exps, down_exps)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=gate_exps.shape[0]).tolist()
    rows_sorted = (order // ids.shape[1])
    w_sorted = weights.reshape(-1)[order]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = rows_sorted[start : start + count]
        xe = x[rows]
        h = F.silu(F.linear(xe, gate_exps[expert])) * F.linear(xe, up_exps[expert])
        y = F.linear(h, down_exps[expert]).float() * w_sorted[start : start + count, None]
        out.index_add_(0, rows, y)
        start += count
    return out.to(x.dtype)


def _moe_grouped(x, weights, ids, gate_exps, up_exps, down_exps) -> torch.Tensor:
    """Rows sorted by expert and one grouped GEMM per projection (torch._grouped_mm, Hopper and
    newer): every routed expert is read once, with no host sync and no weight copies."""
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # not bincount: on CUDA it reads the max back to size its output, a host sync per layer
    counts = torch.zeros(gate_exps.shape[0], dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    rows = order // k
    xs = x[rows]
    g = torch._grouped_mm(xs, gate_exps.transpose(1, 2), offs=offsets)
    u = torch._grouped_mm(xs, up_exps.transpose(1, 2), offs=offsets)
    y = torch._grouped_mm(F.silu(g) * u, down_exps.transpose(1, 2), offs=offsets)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, rows, y.float() * weights.reshape(-1)[order][:, None])
    return out.to(x.dtype)
