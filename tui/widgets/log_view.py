"""Engine and server log lines: follow (tail), search (filter + highlight), source tags."""

from __future__ import annotations

from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.reactive import reactive
from textual.widgets import Input, RichLog, Static

from tui.logs import LogBuffer, LogLine

SOURCE_STYLE = {"server": "cyan", "engine": "magenta", "desk": "green"}


def render_line(line: LogLine, search: str) -> Text:
    text = Text()
    text.append(f"{line.time:8} ", style="dim")
    text.append(f"{line.source:>6} ", style=SOURCE_STYLE.get(line.source, "dim"))
    body = Text(line.text)
    lowered = line.text.lower()
    if any(w in lowered for w in ("error", "traceback", "failed")):
        body.stylize("red")
    elif "warn" in lowered:
        body.stylize("yellow")
    if search:
        body.highlight_words([search], style="black on yellow", case_sensitive=False)
    text.append_text(body)
    return text


class LogView(Vertical, can_focus=True):
    """Shows a LogBuffer. Keys: `/` search, `f` follow on/off, `escape` clears the search."""

    DEFAULT_CSS = """
    LogView { height: 1fr; min-height: 4; }
    LogView RichLog { height: 1fr; background: transparent; scrollbar-size-vertical: 1; }
    LogView #log-search { display: none; height: 3; }
    LogView.-searching #log-search { display: block; }
    LogView #log-status { height: 1; color: $text-muted; }
    """

    BINDINGS = [
        Binding("slash", "search", "Search"),
        Binding("f", "toggle_follow", "Follow"),
        Binding("escape", "clear_search", "Clear search", show=False),
    ]

    follow: reactive[bool] = reactive(True)
    search: reactive[str] = reactive("")

    def __init__(self, buffer: LogBuffer, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.buffer = buffer
        self._seen = 0
        self._width = 0

    def compose(self) -> ComposeResult:
        yield Input(placeholder="search the log (enter to apply, escape to clear)", id="log-search")
        yield RichLog(max_lines=5000, wrap=True, min_width=20, markup=False, highlight=False, auto_scroll=True)
        yield Static("", id="log-status")

    def on_mount(self) -> None:
        self._status()

    def on_resize(self, event: events.Resize) -> None:
        if event.size.width != self._width:  # long lines wrap: wrap them again at the new width
            self._width = event.size.width
            self.refresh_lines(rebuild=True)

    def _status(self) -> None:
        parts = ["following" if self.follow else "paused (f to follow)"]
        if self.search:
            parts.append(f"search: {self.search!r}")
        parts.append("/ search  f follow")
        self.query_one("#log-status", Static).update("  ·  ".join(parts))

    def refresh_lines(self, *, rebuild: bool = False) -> None:
        log = self.query_one(RichLog)
        if rebuild:
            log.clear()
            self._seen = 0
        new = self.buffer.since(self._seen)
        if not new:
            return
        self._seen = new[-1].seq
        needle = self.search.lower()
        for line in new:
            if needle and needle not in line.text.lower():
                continue
            log.write(render_line(line, self.search), expand=True, scroll_end=self.follow)

    def watch_follow(self, follow: bool) -> None:
        if self.is_mounted:
            self.query_one(RichLog).auto_scroll = follow
            if follow:
                self.query_one(RichLog).scroll_end(animate=False)
            self._status()

    def watch_search(self, _: str) -> None:
        if self.is_mounted:
            self.refresh_lines(rebuild=True)
            self._status()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "clear_search":  # escape goes on to the screen when there is nothing to clear
            return bool(self.search) or self.has_class("-searching")
        return True

    def action_toggle_follow(self) -> None:
        self.follow = not self.follow

    def action_search(self) -> None:
        self.add_class("-searching")
        self.query_one("#log-search", Input).focus()

    def action_clear_search(self) -> None:
        self.query_one("#log-search", Input).value = ""
        self.remove_class("-searching")
        self.search = ""
        self.focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.search = event.value.strip()
        if not self.search:
            self.remove_class("-searching")
        self.focus()
