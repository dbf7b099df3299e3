"""A message strip under the header: start-up progress, draining, and errors with the log tail."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from tui.widgets.quiet import update_text


class Banner(Static):
    DEFAULT_CSS = """
    Banner { height: auto; max-height: 16; padding: 0 1; display: none; text-wrap: nowrap; text-overflow: ellipsis; }
    Banner.-info { display: block; background: $primary 25%; }
    Banner.-warn { display: block; background: $warning 25%; }
    Banner.-error { display: block; background: $error 25%; border-left: thick $error; }
    """

    def say(self, level: str | None, message: str = "", detail: str = "", keys: str = "") -> None:
        """level: None hides the banner; 'info', 'warn' or 'error' shows it."""
        for each in ("info", "warn", "error"):
            self.set_class(level == each, f"-{each}")
        if level is None:
            update_text(self, "")
            return
        text = Text(no_wrap=True, overflow="ellipsis")
        text.append(message, style="bold")
        if keys:
            text.append("\n" + keys, style="italic")
        if detail:
            text.append("\n" + detail.rstrip(), style="dim" if level != "error" else "")
        update_text(self, text)
