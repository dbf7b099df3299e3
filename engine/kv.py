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
        # every layer's CUDA device, where they share one: `save` and `load` copy in one launch there
        self.gpu = self.k[0].device if len({t.device for t in self.k}) == 1 and self.k[0].is_cuda else None
        self.sessions = sessions
        self.context = context
        self.max_chunk = max_chunk
        self.rings = min(self.lengths, default=context) < context  # some layer keeps a ring, not the context
        # a position's K and V bytes in each layer (asked before every park: no views made then)
        self._position_bytes = [2 * k[0, :, 0].numel() * k.element_size() for k in self.k]

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
        return sum(size * self.saved(i, n) for i, size in enumerate(self._position_bytes))

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
        """Copy the first `n` positions of session `src` into session `dst` (a ring: all of it): on one CUDA device
        in one launch (a span a KV head, `triton_spans.copy_spans`), not a copy a layer and K/V (~30-40 us of
        host time each, before every read that takes another session's prefix)."""
        if src == dst or n == 0:
            return
        parts = [(cache, self.extent(i, n), cache[dst]) for i, kv in enumerate(zip(self.k, self.v, strict=True))
                 for cache in kv]
        if self.gpu is None:
            _copy_parts(parts, src, None, to_copy=True)
            return
        from engine.kernels.triton_spans import copy_spans  # imports Triton: only on CUDA (and in tests)

        copy_spans(_spans(parts, src, to_copy=True), self.gpu)  # device memory: no pinned block to guard

    def save(self, session: int, n: int, pin: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """A host copy of session `session`, which holds `n` positions: per layer `[kv_heads, m,
        head_dim]`, the first `n` positions (a ring that has wrapped: all of it); in pinned memory when
        `pin` (a CUDA cache), so `load` copies back at full speed.

        The copies are queued on each device's stream and the host does not wait for them: a later write
        to the session, or a `load` of the copy, comes after them on that stream. All of it goes into one
        host allocation. (An H200 machine, 12 layers, ~600 tokens: a pinned tensor per layer copied while the
        host waited took 9-10 ms a park, 28-60 ms while the pinned blocks were new; this takes ~1 ms, ~12 ms.
        A park is in front of the read that parks.) Where every layer is on one CUDA device the copies are one
        Triton launch (`_copy_parts`) instead of a copy_ a layer and K/V (~25-35 us of host time each: ~3 ms a
        park of a 48-layer model)."""
        parts = [(src, self.saved(i, n)) for i, kv in enumerate(zip(self.k, self.v, strict=True)) for src in kv]
        shapes = [src.shape[1:2] + (m,) + src.shape[3:] for src, m in parts]
        host = torch.empty(sum(s.numel() for s in shapes), dtype=self.k[0].dtype, pin_memory=pin)
        copies = [part.view(shape) for part, shape in zip(host.split([s.numel() for s in shapes]), shapes, strict=True)]
        _copy_parts([(src, m, copy) for (src, m), copy in zip(parts, copies, strict=True)], session,
                    self._span_device([host]), to_copy=True)
        return copies[0::2], copies[1::2]

    def load(self, session: int, ks: list[torch.Tensor], vs: list[torch.Tensor], n: int) -> None:
        """Write the first `n` positions of a `save`d copy (a ring: all it saved) back into session `session`;
        from pinned memory the copies are queued on each device's stream and the host does not wait for them
        (torch keeps the pinned blocks from reuse until they are done); one launch on one CUDA device, as `save`'s."""
        parts = [(cache, min(self.extent(i, n), host.shape[1]), host)
                 for i, (k, v, hk, hv) in enumerate(zip(self.k, self.v, ks, vs, strict=True))
                 for cache, host in ((k, hk), (v, hv))]
        _copy_parts(parts, session, self._span_device(ks + vs), to_copy=False)

    def _span_device(self, hosts: list[torch.Tensor]) -> torch.device | None:
        """The device a `save` or `load` copies on in one launch (`_copy_parts`): every layer's CUDA device, when the
        host copy `hosts` is one pinned allocation; else None (a copy_ a layer and K/V)."""
        return self.gpu if self.gpu is not None and _one_pinned_allocation(hosts) else None


def _one_pinned_allocation(tensors: list[torch.Tensor]) -> bool:
    """Whether `tensors` are views of one pinned host allocation (what `save` returns on CUDA)."""
    return len({t.untyped_storage().data_ptr() for t in tensors}) == 1 and tensors[0].is_pinned()


def _head_spans(cache: torch.Tensor, session: int, m: int, copy: torch.Tensor,
                to_copy: bool) -> list[tuple[int, int, int]]:
    """Per KV head, session `session`'s first `m` rows in `cache` and their `copy` (`[kv_heads, >= m, row]`: a host
    copy, or another session of the cache), contiguous bytes in both: (source address, destination address, bytes),
    to the copy (`to_copy`) or back."""
    size = cache.element_size()
    at, step = cache.data_ptr() + session * cache.stride(0) * size, cache.stride(1) * size
    copy_at, copy_step = copy.data_ptr(), copy.stride(0) * size
    rows = m * cache.stride(2) * size
    if to_copy:
        return [(at + h * step, copy_at + h * copy_step, rows) for h in range(cache.shape[1])]
    return [(copy_at + h * copy_step, at + h * step, rows) for h in range(cache.shape[1])]


def _spans(parts: list[tuple[torch.Tensor, int, torch.Tensor]], session: int, to_copy: bool) -> list[tuple[int, int, int]]:
    """`_head_spans` of every (cache, m, copy)."""
    return [span for cache, m, copy in parts for span in _head_spans(cache, session, m, copy, to_copy)]


def _copy_parts(parts: list[tuple[torch.Tensor, int, torch.Tensor]], session: int, device: torch.device | None,
                to_copy: bool) -> None:
    """Copy session `session`'s first m rows of each (cache, m, copy) to the copy (`to_copy`) or back: with `device`
    (`KVCache._span_device`: a pinned host copy) a span a KV head, all in one launch there
    (`triton_spans.copy_spans`) but the last span, which takes a copy_ after it (below); without, a copy_ each,
    queued without the host waiting where the copy is pinned."""
    if device is None:
        for cache, m, copy in parts:
            _copy_rows(cache[session, :, :m], copy[:, :m], to_copy)
        return
    from engine.kernels.triton_spans import copy_spans  # imports Triton: only on CUDA (and in tests)

    parts = [part for part in parts if part[1]]  # the last span holds bytes: its copy_ is what guards the host copy
    if not parts:
        return
    copy_spans(_spans(parts, session, to_copy)[:-1], device)
    # torch's copy_ to or from pinned memory ties the pinned block to the stream (an event there, recorded at the
    # copy or, in newer torch, when the block is freed), so the block is not handed out again before the work
    # queued on it is done; a kernel ties nothing. The host copy may be freed as soon as this returns (a parked
    # entry evicted, a restored one dropped) with the kernel still queued, and its block could go to a new pinned
    # tensor the host writes at once (`to_device`'s staging). So the last span goes by copy_, after the kernel on
    # the same stream: the host copy is one allocation (`_one_pinned_allocation`), kept until the kernel is done.
    cache, m, copy = parts[-1]
    _copy_rows(cache[session, -1, :m], copy[-1, :m], to_copy)


def _copy_rows(rows: torch.Tensor, copy: torch.Tensor, to_copy: bool) -> None:
    """Cache rows to their copy (`to_copy`) or back by torch's copy_, the host not waiting where the copy is pinned."""
    if to_copy:
        copy.copy_(rows, non_blocking=copy.is_pinned())
    else:
        rows.copy_(copy, non_blocking=copy.is_pinned())


def _row(head_dim: int, dtype: torch.dtype) -> int:
    """A cached row's last dimension: head_dim values, or a Q8_0 row's bytes."""
    return kv_blocks.row_bytes(head_dim) if dtype == kv_blocks.DTYPE else head_dim


def kv_name(dtype: torch.dtype) -> str:
    """What INFO says of a cache's storage: `q8_0`, else the dtype's name (`float16`, ...)."""
    return "q8_0" if dtype == kv_blocks.DTYPE else str(dtype).removeprefix("torch.")
