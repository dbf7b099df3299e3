"""The top bar: model, state, the URL to give clients (click or `c` copies it), uptime, engine."""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.message import Message
from textual.widgets import Static

from tui.format import duration
from tui.view import DashState

STATE_STYLE: dict[str, str] = {
    "loading": "bold black on #ffd75f",
    "ready": "bold black on #5fd75f",
    "busy": "bold black on #5fafff",
    "error": "bold white on #d70000",
    "stopped": "bold white on grey37",
}


@dataclass
class HeaderInfo:
    model: str = ""
    state: DashState = "loading"
    url: str = ""
    uptime_s: float | None = None
    version: str | None = None
    mode: str = ""  # "managed", "attached"
    detail: str = ""  # e.g. "starting the engine (12 s)"
    restarts: int = 0  # times the server had to restart a dead engine
    key: bool = False  # clients need an API key
    last_error: str | None = None


class UrlLabel(Static):
    """The client URL; a click copies it."""

    class Clicked(Message):
        pass

    def on_click(self) -> None:
        self.post_message(self.Clicked())


class HeaderBar(Horizontal):
    DEFAULT_CSS = """
    HeaderBar { height: 1; background: $panel; padding: 0 1; }
    HeaderBar > Static { width: auto; margin-right: 2; }
    HeaderBar #hdr-model { text-style: bold; color: $text; }
    HeaderBar #hdr-url { color: $accent; text-style: underline; }
    HeaderBar #hdr-url:hover { background: $accent 30%; }
    HeaderBar #hdr-detail { width: 1fr; text-wrap: nowrap; text-overflow: ellipsis; color: $text-muted; }
    HeaderBar #hdr-right { margin-right: 0; color: $text-muted; }
    """

    def compose(self) -> ComposeResult:
        yield Static("strata-desk", id="hdr-model")
        yield Static("", id="hdr-state")
        yield UrlLabel("", id="hdr-url")
        yield Static("", id="hdr-detail")
        yield Static("", id="hdr-right")

    def show(self, info: HeaderInfo) -> None:
        self.query_one("#hdr-model", Static).update(info.model or "strata-desk")
        self.query_one("#hdr-state", Static).update(
            Text(f" {info.state} ", style=STATE_STYLE.get(info.state, "reverse"))
        )
        url = self.query_one("#hdr-url", UrlLabel)
        url.update(info.url)
        url.tooltip = "click or press c to copy" if info.url else None
        self.query_one("#hdr-detail", Static).update(Text(info.detail, style="italic"))
        parts: list[str | Text] = []
        right = self.query_one("#hdr-right", Static)
        if info.restarts:
            parts.append(Text(f"engine restarted {info.restarts}x", style="bold yellow"))
            right.tooltip = f"last engine error: {info.last_error}" if info.last_error else None
        if info.key:
            parts.append(Text("API key on", style="bold"))
        if info.uptime_s is not None:
            parts.append(f"up {duration(info.uptime_s)}")
        if info.version:
            parts.append(f"engine {info.version}")
        if info.mode == "attached":
            parts.append("attached")
        right.update(Text("  ").join(Text(p) if isinstance(p, str) else p for p in parts))
