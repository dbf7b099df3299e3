"""The dashboard's log box: a LogView in a Panel (`l` opens the full-screen log)."""

from __future__ import annotations

from textual.app import ComposeResult

from server.metrics_schema import MetricsSnapshot
from tui.logs import LogBuffer
from tui.view import History
from tui.widgets.log_view import LogView
from tui.widgets.panel import Panel


class LogPanel(Panel):
    DEFAULT_CSS = """
    LogPanel { height: 1fr; }
    """

    def __init__(self, buffer: LogBuffer, *, id: str | None = "logs") -> None:
        super().__init__("Log (server + engine)", "6", id=id)
        self.buffer = buffer

    def compose(self) -> ComposeResult:
        yield LogView(self.buffer)

    def show(self, snapshot: MetricsSnapshot | None, history: History) -> None:
        self.query_one(LogView).refresh_lines()
