"""Building blocks shared by the architectures: norms, rotary embedding, attention over sessions.

Every function takes the rows of a batch flattened to `[N, ...]` (engine/batch.py says which rows
belong to which session and where). All arithmetic on a row depends only on that row (and its
session's cache), except the matrix products that mix the rows of one call: that is why exact mode
runs decode rows one call each (engine/runner.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine import kv_blocks
from engine.batch import Batch, Span
from engine.kernels import gpu as gpu_kernels
from engine.kernels import ops as cpu_ops

ATTEND_BUCKET = 256
# cuDNN's attention gave other bits for the same call, run to run, on an H200 (two eager runs of the same
# windows); torch's other backends give the same bits every run.
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# rows of a CPU prompt chunk's attention a call (`_blocked_sdpa`): 64 for a chunk from its session's start (the
# fastest of 32-512 at 512 rows), 256 for one after at least as many keys (512 rows after 512, 1,536 and 3,584
# keys: 45.0 -> 40.3, 105.2 -> 88.5, 233.6 -> 179.0 ms a layer of Qwen3-30B-A3B's heads on 2 cores)
PROMPT_BLOCK, LATER_PROMPT_BLOCK = 64, 256
# torch 2.5 added `enable_gqa`: a CPU chunk's attention then reads each KV head for its query heads instead of a
# copy repeated per query head (the same bits; 512 rows over 4,096 keys of Qwen3-30B-A3B's heads: 341 -> 226 ms)
GQA_IN_SDPA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)


def _on_triton(x: torch.Tensor) -> bool:
    """Whether x's row ops run as Triton kernels (CUDA tensors, where the kernels can run)."""
    return x.is_cuda and gpu_kernels.available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _on_triton(x):
        from engine.kernels import triton_rows  # imports Triton, so only when a CUDA tensor comes

        return triton_rows.rms_norm(x, weight, eps)
    if cpu_ops.usable(x):
        return cpu_ops.rms_norm(x, weight, eps)
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def add_rms_norm(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream after adding r, and its RMSNorm: (x + r, rms_norm(x + r)); on CUDA in one
    launch, with the bits of the two ops run apart."""
    if _on_triton(x):
        from engine.kernels import triton_rows  # imports Triton, so only when a CUDA tensor comes

        return triton_rows.add_rms_norm(x, r, weight, eps)
    if cpu_ops.usable(x):
        return cpu_ops.add_rms_norm(x, r, weight, eps)
    s = x + r
    return s, rms_norm(s, weight, eps)


def gelu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """F.gelu(gate, approximate="tanh") * up (a GELU-gated FFN)."""
    if cpu_ops.usable(gate):
        return cpu_ops.gated("gelu_tanh", gate, up)
    return F.gelu(gate, approximate="tanh") * up


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up (SwiGLU)."""
    if cpu_ops.usable(gate):
        return cpu_ops.gated("silu", gate, up)
    return F.silu(gate) * up


def add(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """x + r (a residual add)."""
    if cpu_ops.usable(x):
        return cpu_ops.add(x, r)
    return x + r


def scale(x: torch.Tensor, s: float) -> torch.Tensor:
    """x * s (s a float32 value: torch multiplies x's values by it in float32, as the C op does)."""
    if cpu_ops.usable(x):
        return cpu_ops.scale(x, s)
    return x * s


class Rope:
    """Rotary embedding, tables precomputed for the whole context. `neox`: rotate halves, pairs
    (i, i + D/2); else llama.cpp's normal rope, adjacent pairs (2i, 2i + 1), as GGUF llama files
    expect (the converter permutes their q/k rows for it)."""

    def __init__(self, head_dim: int, base: float, context: int, device: torch.device, neox: bool = True):
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        angles = torch.arange(context, dtype=torch.float64)[:, None] * inv_freq[None, :]
        self.cos = angles.cos().float().to(device)
        self.sin = angles.sin().float().to(device)
        self.neox = neox
        self._copies: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin on `device`: the tables, or a copy made once for a later stage of a layer split."""
        if device == self.cos.device:
            return self.cos, self.sin
        if device not in self._copies:
            self._copies[device] = (self.cos.to(device), self.sin.to(device))
        return self._copies[device]

    def pair(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
             q_norm: tuple[torch.Tensor, float] | None = None, k_norm: tuple[torch.Tensor, float] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's q and k rotated (each normed first with its own weight, when given): on CUDA in one
        launch."""
        if _on_triton(q):
            from engine.kernels import triton_rows  # imports Triton, so only when a CUDA tensor comes

            cos, sin = self._tables(q.device)
            return triton_rows.rope_pair(q, k, positions, cos, sin, self.neox, q_norm, k_norm)
        return self(q, positions, q_norm), self(k, positions, k_norm)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None
                 ) -> torch.Tensor:
        """x: [N, heads, head_dim]; positions: [N], on x's device. `norm` (weight, eps): each head
        RMS-normed first (on CUDA in the same launch)."""
        cos, sin = self._tables(x.device)
        if _on_triton(x):
            from engine.kernels import triton_rows  # imports Triton, so only when a CUDA tensor comes

            return triton_rows.rope(x, positions, cos, sin, self.neox, norm)
        if norm is not None:
            x = rms_norm(x, *norm)
        if cpu_ops.usable(x):
            return cpu_ops.rope(x, positions, cos, sin, self.neox)
        cos, sin = cos[positions][:, None, :], sin[positions][:, None, :]
        if self.neox:
            x1, x2 = x.float().chunk(2, dim=-1)
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(x.dtype)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: Batch,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Write the rows' k/v into their sessions' caches, then attend each span over its session.

    q: [N, Hq, D]; k, v: [N, Hkv, D]; caches: [sessions, Hkv, length, D], position p in slot
    p % length (a sliding layer's ring; the identity for a full layer). Returns [N, Hq * D].
    `window` limits each query to the last `window` positions (sliding-window layers).
    """
    if rows.single_rows and q.is_cuda:  # one launch, of a shape a CUDA graph keeps; on the CPU padding costs more
        return _attend_rows(q, k, v, k_cache, v_cache, rows, scale, window)
    if rows.single_rows and cpu_ops.usable(q):  # one call, which reads the rows' sessions and positions itself
        return cpu_ops.attend_rows(q, k, v, k_cache, v_cache, rows.sessions, rows.positions, window, scale)
    if q.is_cuda and len(rows.spans) > 1:  # a burst's reads together: every span in one call a layer
        from engine import span_attention  # CUDA only

        if span_attention.usable(q, rows, window):
            out = span_attention.attend(q, k, v, k_cache, v_cache, rows, scale)
            if out is not None:
                return out
    out = []
    row = 0
    n_rep = q.shape[1] // k.shape[1]
    ring = k_cache.shape[2]
    for span in rows.spans:
        part = slice(row, row + span.length)
        row += span.length
        lo = 0 if window is None else max(0, span.start - window + 1)
        if span.length == 1 and cpu_ops.usable(q):  # writes its k/v and reads the ring in place
            out.append(cpu_ops.attend_row(q[part.start], k[part.start], v[part.start], k_cache[span.session],
                                          v_cache[span.session], lo, span.end, scale))
            continue
        if span.end <= ring:  # no wrap: plain slices
            k_cache[span.session, :, span.start : span.end] = kv_blocks.store(k[part].transpose(0, 1), k_cache.dtype)
            v_cache[span.session, :, span.start : span.end] = kv_blocks.store(v[part].transpose(0, 1), v_cache.dtype)
            keys, values = k_cache[span.session, :, lo : span.end], v_cache[span.session, :, lo : span.end]
        else:
            slots = torch.arange(span.start, span.end, device=q.device) % ring
            k_cache[span.session][:, slots] = kv_blocks.store(k[part].transpose(0, 1), k_cache.dtype)
            v_cache[span.session][:, slots] = kv_blocks.store(v[part].transpose(0, 1), v_cache.dtype)
            seen = torch.arange(lo, span.end, device=q.device) % ring
            keys, values = k_cache[span.session][:, seen], v_cache[span.session][:, seen]
        keys, values = kv_blocks.load(keys, q.dtype), kv_blocks.load(values, q.dtype)
        if span.length == 1:
            out.append(_attend_one(q[part], keys, values, scale))
            continue
        # 4-D: torch's fused kernels take it (3-D goes to the math path: on the CPU 2.5x slower at 512 rows)
        qs = q[part].transpose(0, 1)[None]  # [1, Hq, T, D]
        if window is None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256:
            o = _causal_sdpa(qs, keys[None], values[None], scale)
        else:
            gqa = GQA_IN_SDPA and not q.is_cuda  # each KV head shared by its query heads, not repeated in memory
            if not gqa:
                keys, values = keys.repeat_interleave(n_rep, dim=0), values.repeat_interleave(n_rep, dim=0)
            keys, values = keys[None], values[None]
            q_pos = torch.arange(span.start, span.end, device=q.device)[:, None]
            k_pos = torch.arange(lo, span.end, device=q.device)[None, :]
            mask = k_pos <= q_pos
            if window is not None:
                mask &= q_pos - k_pos < window
            if q.is_cuda or span.length <= PROMPT_BLOCK:
                o = _sdpa(qs, keys, values, mask[None, None], scale, gqa)
            else:
                o = _blocked_sdpa(qs, keys, values, mask, scale, span.start - lo, window, gqa)
        out.append(o[0].transpose(0, 1).reshape(span.length, -1))
    return out[0] if len(out) == 1 else torch.cat(out, dim=0)


def _attend_one(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """One query row over all its keys (a decode row sees every key it is given): plain batched
    products per KV head, without the mask, the GQA copies and the dispatch of a fused attention
    call, which cost more than the arithmetic at this size. q: [1, Hq, D]; keys, values: [Hkv, L, D]."""
    kv_heads = keys.shape[0]
    qh = q.view(kv_heads, -1, q.shape[-1])  # [Hkv, n_rep, D]
    weights = torch.softmax(torch.bmm(qh, keys.transpose(1, 2)) * scale, dim=-1)
    return torch.bmm(weights, values).reshape(1, -1)


def attend_bucket(spans: list[Span], fused: bool = True) -> int:
    """The keys a decode step's attention call is shaped for: 0 where the fused kernel runs (`fused`:
    CUDA tensors, and Triton: it reads each row's length on the device, so one shape serves every
    length), else the longest session padded to a multiple of ATTEND_BUCKET, so that the padded call
    sees a handful of shapes instead of a new one every step (a CUDA graph is captured per shape)."""
    if fused and gpu_kernels.available():
        return 0
    return -(-max(s.end for s in spans) // ATTEND_BUCKET) * ATTEND_BUCKET


def _attend_rows(q, k, v, k_cache, v_cache, rows: Batch, scale: float, window: int | None) -> torch.Tensor:
    """A decode step (one row per session) over the sessions' caches: the fused kernel
    (engine/kernels/triton_attention.py, each row over its own keys, long rows split over programs), or
    (without Triton) one attention call padded to `attend_bucket` and masked per row, whose
    reductions depend on the other rows' lengths (so exact mode runs rows one at a time: a row alone
    takes the path and pads to the bucket of its own length)."""
    spans, sessions, pos = rows.spans, rows.sessions, rows.positions
    ring = k_cache.shape[2]
    bucket = attend_bucket(spans, fused=q.is_cuda)
    if bucket == 0:
        from engine.kernels.triton_attention import decode_attention  # imports Triton: only on CUDA

        return decode_attention(q, k, v, k_cache, v_cache, sessions, pos, scale, window)
    k_cache[sessions, :, pos % ring] = k.to(k_cache.dtype)
    v_cache[sessions, :, pos % ring] = v.to(v_cache.dtype)
    length = min(bucket, ring)
    n_rep = q.shape[1] // k.shape[1]
    keys = k_cache[sessions, :, :length].to(q.dtype).repeat_interleave(n_rep, dim=1)  # [R, Hq, L, D]
    values = v_cache[sessions, :, :length].to(q.dtype).repeat_interleave(n_rep, dim=1)
    slot = torch.arange(length, device=q.device)[None, :]
    k_pos = pos[:, None] - (pos[:, None] - slot) % ring  # the position each slot holds (<= pos)
    mask = k_pos >= 0
    if window is not None:
        mask &= pos[:, None] - k_pos < window
    o = _sdpa(q[:, :, None, :], keys, values, mask[:, None, None, :], scale)
    return o.reshape(len(spans), -1)


def _causal_sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """A prompt chunk's attention where each row sees every key up to its own (no window), its rows the
    last of the keys: the causal mask aligned to the last key (`causal_lower_right`) and each KV head
    shared by its query heads (`enable_gqa`), so torch's flash kernel runs without a mask or repeated
    keys in memory (both grow with the keys seen: at the end of a 16K context an 8,192-token chunk
    peaked at 600 MiB with them, 288 MiB without them and its MoE buffers borrowed, on an H200).
    q [1, Hq, T, D]; keys, values [1, Hkv, L, D], L >= T."""
    # imported here, not at the top: the module imports torch._dynamo, 1.3 s of a CPU engine's start
    from torch.nn.attention.bias import causal_lower_right

    with sdpa_kernel(_SDPA_BACKENDS):
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=causal_lower_right(q.shape[2], keys.shape[2]),
                                              scale=scale, enable_gqa=True)


def _blocked_sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float,
                  first: int, window: int | None, gqa: bool = False) -> torch.Tensor:
    """A prompt chunk's attention on the CPU, its rows PROMPT_BLOCK at a time (LATER_PROMPT_BLOCK after at least
    as many keys), each block over only the keys its rows can see: torch's CPU kernel computes every key of a
    masked call, so one call over the chunk does the whole square where the causal mask leaves half of it (512
    rows, 4 heads of 256: 7.6 -> 5.2 ms). q [1, H, T, D]; keys, values [1, H, L, D]; mask [T, L]; row i sees key
    `first + i` and those before it (within `window`); `gqa`: keys and values have fewer heads than q, each
    shared by its query heads."""
    out = []
    block = PROMPT_BLOCK if first < q.shape[2] else LATER_PROMPT_BLOCK
    for a in range(0, q.shape[2], block):
        b = min(a + block, q.shape[2])
        lo = 0 if window is None else max(0, first + a - window + 1)
        hi = first + b
        out.append(_sdpa(q[:, :, a:b], keys[:, :, lo:hi], values[:, :, lo:hi], mask[a:b, lo:hi][None, None], scale, gqa))
    return torch.cat(out, dim=2)


def _sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
          scale: float, gqa: bool = False) -> torch.Tensor:
    with sdpa_kernel(_SDPA_BACKENDS):
        if gqa:
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
