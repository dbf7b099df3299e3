"""The rows of one forward pass: which session each row feeds, at which position, with which token.

A prompt chunk is one span of many rows; a decode step is one span of one row per session. The
runner builds a `Batch` with `BatchBuilder`: every index the layers need is packed into one
persistent host buffer and sent to the device in one copy (a copy per layer would make every
layer wait for the GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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

    @property
    def single_rows(self) -> bool:
        """A decode step of several sessions, one row each."""
        return len(self.spans) > 1 and all(s.length == 1 for s in self.spans)


class BatchBuilder:
    """Builds batches of up to `max_rows` rows and `max_spans` spans into buffers kept for the run."""

    def __init__(self, device: torch.device, max_rows: int, max_spans: int):
        size = 2 * max_rows + 2 * max_spans
        self.device = device
        self.max_rows, self.max_spans = max_rows, max_spans
        pin = device.type == "cuda"
        self.host = torch.empty(size, dtype=torch.int64, pin_memory=pin)
        self.dev = self.host if device.type == "cpu" else torch.empty(size, dtype=torch.int64, device=device)
        self.copied = torch.cuda.Event() if pin else None

    def build(self, spans: list[Span], tokens: list[int]) -> Batch:
        n, r = len(tokens), len(spans)
        if n != sum(s.length for s in spans) or n > self.max_rows or r > self.max_spans:
            raise ValueError(f"a batch of {n} rows in {r} spans (at most {self.max_rows} rows, {self.max_spans} spans)")
        ends, total = [], 0
        for s in spans:
            total += s.length
            ends.append(total - 1)
        packed = tokens + [p for s in spans for p in range(s.start, s.end)] + ends + [s.session for s in spans]
        if self.copied is not None:
            self.copied.synchronize()  # the previous batch's copy has left the host buffer
        self.host[: len(packed)] = torch.tensor(packed)
        if self.dev is not self.host:
            self.dev[: len(packed)].copy_(self.host[: len(packed)], non_blocking=True)
            self.copied.record()
        d = self.dev
        return Batch(spans, d[:n], d[n : 2 * n], d[2 * n : 2 * n + r], d[2 * n + r : 2 * n + 2 * r])
