"""The top bar: model, state, the URL to give clients (click or `c` copies it), uptime, engine."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.message import Message
from textual.widgets import Static

from tui.format import duration
from tui.view import HeaderInfo
from tui.widgets.quiet import update_text

STATE_STYLE: dict[str, str] = {
    "loading": "bold black on #ffd75f",
    "ready": "bold black on #5fd75f",
    "busy": "bold black on #5fafff",
    "error": "bold white on #d70000",
    "stopped": "bold white on grey37",
}


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
    HeaderBar #hdr-model { text-style: bold; color: $text; max-width: 32; text-wrap: nowrap; text-overflow: ellipsis; }
    HeaderBar #hdr-url { color: $accent; text-style: underline; }
    HeaderBar #hdr-url:hover { background: $accent 30%; }
    HeaderBar #hdr-detail { width: 1fr; text-wrap: nowrap; text-overflow: ellipsis; color: $text-muted; }
    HeaderBar #hdr-right { margin-right: 0; color: $text-muted; }
    """

    _info: HeaderInfo | None = None

    def compose(self) -> ComposeResult:
        yield Static("strata-desk", id="hdr-model")
        yield Static("", id="hdr-state")
        yield UrlLabel("", id="hdr-url")
        yield Static("", id="hdr-detail")
        yield Static("", id="hdr-right")

    def on_resize(self) -> None:
        if self._info is not None:
            self.show(self._info)

    def show(self, info: HeaderInfo) -> None:
        self._info = info
        update_text(self.query_one("#hdr-model", Static), info.model or "strata-desk")
        update_text(self.query_one("#hdr-state", Static),
            Text(f" {info.state} ", style=STATE_STYLE.get(info.state, "reverse"))
        )
        url = self.query_one("#hdr-url", UrlLabel)
        update_text(url, info.url)
        url.tooltip = "click or press c to copy" if info.url else None
        update_text(self.query_one("#hdr-detail", Static), Text(info.detail, style="italic"))
        right = self.query_one("#hdr-right", Static)
        if info.restarts:
            right.tooltip = f"last engine error: {info.last_error}" if info.last_error else None
        room = self.size.width - sum(len(t) + 2 for t in (info.model, f" {info.state} ", info.url))
        update_text(right, Text("  ").join(right_parts(info, room - len(info.detail) - 2)))


def right_parts(info: HeaderInfo, room: int) -> list[Text]:
    """The right-hand facts that fit in `room` columns, the least needed left out first (engine
    version, uptime), so a narrow terminal still shows the state and what the server is doing."""
    parts = [  # (keep order, drop order: the higher goes first)
        (Text(f"engine restarted {info.restarts}x", style="bold yellow") if info.restarts else None, 0),
        (Text("API key on", style="bold") if info.key else None, 1),
        (Text(f"up {duration(info.uptime_s)}") if info.uptime_s is not None else None, 3),
        (Text(f"engine {info.version}") if info.version else None, 4),
        (Text("attached") if info.mode == "attached" else None, 2),
    ]
    kept = [(text, rank) for text, rank in parts if text is not None]
    while kept and sum(len(text) + 2 for text, _ in kept) - 2 > room:
        kept.remove(max(kept, key=lambda item: item[1]))
    return [text for text, _ in kept]
