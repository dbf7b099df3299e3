"""The rows of one forward pass: which session each row feeds, at which position, with which token.

A prompt chunk is one span of many rows; a decode step is one span of one row per session. The
runner builds a `Batch` with `BatchBuilder`: every index the layers need is packed into one
persistent host buffer and sent to the device in one copy (a copy per layer would make every
layer wait for the GPU).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from engine.placement import on_device


@dataclass(frozen=True)
class Span:
    """`length` consecutive rows of the batch that feed `session` from position `start`."""

    session: int
    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class Batch:
    spans: list[Span]
    tokens: torch.Tensor  # [N] token of every row
    positions: torch.Tensor  # [N] position of every row
    last: torch.Tensor  # [len(spans)] index of each span's last row
    sessions: torch.Tensor  # [len(spans)] session of each span

    def to(self, device: torch.device) -> Batch:
        """The same rows with their indices on `device` (a later stage of a layer split), copied without
        a host wait; the batch itself when it is there already."""
        if on_device(self.tokens, device):
            return self
        return Batch(self.spans, *(t.to(device, non_blocking=True) for t in (self.tokens, self.positions, self.last, self.sessions)))

    @functools.cached_property
    def span_index(self) -> SpanIndex:
        """The rows and keys by session, on the batch's device: built once a forward, when a layer asks
        (several spans attended in one call, engine/span_attention.py)."""
        return index_spans(self.spans, self.tokens.device)

    @property
    def single_rows(self) -> bool:
        """A decode step: one row for each of its sessions."""
        return all(s.length == 1 for s in self.spans)


@dataclass(frozen=True)
class SpanIndex:
    """A forward's rows and keys by session, on the device (one copy from the host): int64 for indexing (int32 indices
    cost torch a conversion at every use), the cumulative lengths int32 as torch's flash kernel takes them."""

    row_sessions: torch.Tensor  # [N] each row's session
    key_sessions: torch.Tensor  # [K] each key's session, the spans' keys one after another
    key_positions: torch.Tensor  # [K] each key's position in its session: 0 .. span.end - 1
    cum_rows: torch.Tensor  # [S + 1] where each span's rows start, then N
    cum_keys: torch.Tensor  # [S + 1] where each span's keys start, then K
    max_rows: int
    max_keys: int


def index_spans(spans: list[Span], device: torch.device) -> SpanIndex:
    """The index of `spans`' rows and keys (a span's keys: its session's positions up to its last row), built on
    the host and sent to `device` in one copy."""
    sessions = torch.tensor([s.session for s in spans])
    lengths = torch.tensor([s.length for s in spans])
    ends = torch.tensor([s.end for s in spans])
    zero = torch.zeros(1, dtype=torch.int64)
    cum_rows, cum_keys = torch.cat([zero, lengths.cumsum(0)]), torch.cat([zero, ends.cumsum(0)])
    key_positions = torch.arange(int(cum_keys[-1])) - cum_keys[:-1].repeat_interleave(ends)
    parts = [sessions.repeat_interleave(lengths), sessions.repeat_interleave(ends), key_positions, cum_rows, cum_keys]
    packed = torch.cat(parts)
    if device.type == "cuda":
        packed = packed.pin_memory().to(device, non_blocking=True)
    rows, key_sessions, key_positions, cum_rows, cum_keys = packed.split([p.numel() for p in parts])
    return SpanIndex(rows, key_sessions, key_positions, cum_rows.to(torch.int32), cum_keys.to(torch.int32),
                     max(s.length for s in spans), max(s.end for s in spans))


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A short host list as a tensor on `device`, without the host waiting: torch's copy of pageable memory
    to a CUDA device waits for the stream, so a window queued ahead would wait for the one before it."""
    host = torch.tensor(values, dtype=dtype)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)


class BatchBuilder:
    """Builds batches into buffers kept for the run (grown when a batch needs more room)."""

    def __init__(self, device: torch.device, max_rows: int, max_spans: int):
        self.device = device
        self.copied = torch.cuda.Event() if device.type == "cuda" else None
        self._allocate(2 * max_rows + 2 * max_spans)

    def _allocate(self, size: int) -> None:
        self.host = torch.empty(size, dtype=torch.int64, pin_memory=self.copied is not None)
        self.dev = self.host if self.copied is None else torch.empty(size, dtype=torch.int64, device=self.device)

    def build(self, spans: list[Span], tokens: list[int]) -> Batch:
        n, r = len(tokens), len(spans)
        if n != sum(s.length for s in spans):
            raise ValueError(f"{n} tokens for spans of {sum(s.length for s in spans)} rows")
        ends, total = [], 0
        for s in spans:
            total += s.length
            ends.append(total - 1)
        packed = tokens + [p for s in spans for p in range(s.start, s.end)] + ends + [s.session for s in spans]
        if self.copied is not None:
            self.copied.synchronize()  # the previous batch's copy has left the host buffer
        if len(packed) > self.host.numel():
            self._allocate(len(packed))
        self.host[: len(packed)] = torch.tensor(packed)
        if self.copied is not None:
            self.dev[: len(packed)].copy_(self.host[: len(packed)], non_blocking=True)
            self.copied.record()
        d = self.dev
        return Batch(spans, d[:n], d[n : 2 * n], d[2 * n : 2 * n + r], d[2 * n + r : 2 * n + 2 * r])
