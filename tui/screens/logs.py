"""`l`: the server and engine log full screen, with search and follow."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Footer, Static

from tui.logs import LogBuffer
from tui.widgets.log_view import LogView


class LogsScreen(Screen[None]):
    BINDINGS = [Binding("escape,l", "app.pop_screen", "Back")]

    def __init__(self, buffer: LogBuffer, sources: str = "") -> None:
        super().__init__(id="logs-screen")
        self.buffer = buffer
        self.sources = sources

    def compose(self) -> ComposeResult:
        yield Static(f"Log  {self.sources}", classes="screen-title")
        yield LogView(self.buffer, id="full-log")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(LogView).focus()

    def refresh_logs(self) -> None:
        self.query_one(LogView).refresh_lines()
