"""Messages the app sends its screens."""

from __future__ import annotations

from textual.message import Message

from server.metrics_schema import MetricsSnapshot


class SnapshotUpdated(Message):
    """A new /metrics snapshot was read (or the view was redrawn with the last one); `inflight`:
    the requests running or waiting (0 while the server cannot be read)."""

    bubble = False  # for the screen it is sent to, not the app

    def __init__(self, snapshot: MetricsSnapshot, inflight: int = 0) -> None:
        super().__init__()
        self.snapshot = snapshot
        self.inflight = inflight
