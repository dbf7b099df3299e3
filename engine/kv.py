"""Per-session KV caches, preallocated so a window's shapes never change.

A full-attention layer keeps the whole context. A sliding-window layer keeps a ring of
`window + max_chunk` positions (position p in slot p % ring): enough for a chunk of `max_chunk`
rows whose first row still sees `window` positions back. The ring is what makes a 32K-context
Gemma 3 session cost a few MiB instead of hundreds, and it is also why a ring layer can only
continue a session from near its end (`usable_prefix`).
"""

from __future__ import annotations

import torch

from engine import kv_blocks
from engine.hyper import ring_lengths
from engine.placement import on_device

KV_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "q8_0": kv_blocks.DTYPE}


class KVCache:
    """Keys and values of every layer for `sessions` sessions: `[sessions, kv_heads, length, head_dim]`
    (Q8_0, `kv_blocks.DTYPE`: uint8 rows of `kv_blocks.row_bytes(head_dim)`), `length` per layer from
    `ring_lengths`; each layer on `device`, or on its own device from `devices` (a layer split: its
    stage's)."""

    def __init__(self, windows: tuple[int | None, ...], sessions: int, kv_heads: int, context: int, head_dim: int,
                 max_chunk: int, dtype: torch.dtype, device: torch.device,
                 devices: list[torch.device] | None = None):
        self.lengths = ring_lengths(windows, context, max_chunk)
        on = devices or [device] * len(self.lengths)
        if len(on) != len(self.lengths):
            raise ValueError(f"{len(on)} devices for {len(self.lengths)} layers")
        row = _row(head_dim, dtype)
        shapes = [((sessions, kv_heads, n, row), d) for n, d in zip(self.lengths, on, strict=True)]
        self.k = [torch.zeros(shape, dtype=dtype, device=d) for shape, d in shapes]
        self.v = [torch.zeros(shape, dtype=dtype, device=d) for shape, d in shapes]
        self.sessions = sessions
        self.context = context
        self.max_chunk = max_chunk
        self.rings = min(self.lengths, default=context) < context  # some layer keeps a ring, not the context

    @staticmethod
    def bytes_per_session(windows: tuple[int | None, ...], kv_heads: int, context: int, head_dim: int,
                          max_chunk: int, dtype: torch.dtype) -> int:
        positions = sum(ring_lengths(windows, context, max_chunk))
        return 2 * positions * kv_heads * _row(head_dim, dtype) * torch.empty(0, dtype=dtype).element_size()

    def session_bytes(self, device: torch.device | None = None) -> int:
        """One session's bytes (on `device` only, when given)."""
        return sum(t[0].numel() * t.element_size() for t in self.k + self.v if device is None or on_device(t, device))

    def saved(self, layer: int, n: int) -> int:
        """The positions of `layer` a `save` of a session holding `n` positions copies."""
        return min(self.extent(layer, n), n)

    def saved_bytes(self, n: int) -> int:
        """The bytes of a `save` of a session holding `n` positions."""
        return sum(2 * k[0, :, :1].numel() * k.element_size() * self.saved(i, n) for i, k in enumerate(self.k))

    def usable_prefix(self, held: int, n: int) -> int:
        """Of the first `n` positions of a session that wrote `held`, how many a read can continue
        from: all when every ring still holds the `window` positions before `n`, else none."""
        shortest = min(self.lengths)
        if n == 0 or held <= shortest or shortest == self.context:
            return n
        # the ring kept positions held - shortest .. held - 1; continuing at n reads back to n - window
        return n if n >= held - self.max_chunk else 0

    def extent(self, layer: int, n: int) -> int:
        """The positions of `layer` that hold a session's first `n` tokens (a ring: all of it)."""
        length = self.lengths[layer]
        return n if length == self.context else length

    def copy(self, src: int, dst: int, n: int) -> None:
        """Copy the first `n` positions of session `src` into session `dst` (a ring: all of it)."""
        if src == dst or n == 0:
            return
        for i, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
            m = self.extent(i, n)
            k[dst, :, :m] = k[src, :, :m]
            v[dst, :, :m] = v[src, :, :m]

    def save(self, session: int, n: int, pin: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """A host copy of session `session`, which holds `n` positions: per layer `[kv_heads, m,
        head_dim]`, the first `n` positions (a ring that has wrapped: all of it); in pinned memory when
        `pin` (a CUDA cache), so `load` copies back at full speed.

        The copies are queued on each device's stream and the host does not wait for them: a later write
        to the session, or a `load` of the copy, comes after them on that stream. All of it goes into one
        host allocation. (An H200 machine, 12 layers, ~600 tokens: a pinned tensor per layer copied while the
        host waited took 9-10 ms a park, 28-60 ms while the pinned blocks were new; this takes ~1 ms, ~12 ms.
        A park is in front of the read that parks.)"""
        parts = [(src, self.saved(i, n)) for i, kv in enumerate(zip(self.k, self.v, strict=True)) for src in kv]
        shapes = [src.shape[1:2] + (m,) + src.shape[3:] for src, m in parts]
        host = torch.empty(sum(s.numel() for s in shapes), dtype=self.k[0].dtype, pin_memory=pin)
        copies = [part.view(shape) for part, shape in zip(host.split([s.numel() for s in shapes]), shapes, strict=True)]
        for (src, m), copy in zip(parts, copies, strict=True):
            copy.copy_(src[session, :, :m], non_blocking=pin)
        return copies[0::2], copies[1::2]

    def load(self, session: int, ks: list[torch.Tensor], vs: list[torch.Tensor], n: int) -> None:
        """Write the first `n` positions of a `save`d copy (a ring: all it saved) back into session `session`;
        from pinned memory the copies are queued on each device's stream and the host does not wait for them
        (torch keeps the pinned blocks from reuse until they are done)."""
        for i, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
            m = min(self.extent(i, n), ks[i].shape[1])
            k[session, :, :m].copy_(ks[i][:, :m], non_blocking=ks[i].is_pinned())
            v[session, :, :m].copy_(vs[i][:, :m], non_blocking=vs[i].is_pinned())


def _row(head_dim: int, dtype: torch.dtype) -> int:
    """A cached row's last dimension: head_dim values, or a Q8_0 row's bytes."""
    return kv_blocks.row_bytes(head_dim) if dtype == kv_blocks.DTYPE else head_dim


def kv_name(dtype: torch.dtype) -> str:
    """What INFO says of a cache's storage: `q8_0`, else the dtype's name (`float16`, ...)."""
    return "q8_0" if dtype == kv_blocks.DTYPE else str(dtype).removeprefix("torch.")
