"""Messages the app sends its screens."""

from __future__ import annotations

from textual.message import Message

from server.metrics_schema import MetricsSnapshot


class SnapshotUpdated(Message):
    """A new /metrics snapshot was read (or the view was redrawn with the last one)."""

    bubble = False  # for the screen it is sent to, not the app

    def __init__(self, snapshot: MetricsSnapshot) -> None:
        super().__init__()
        self.snapshot = snapshot
