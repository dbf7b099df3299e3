"""A message strip under the header: start-up progress, draining, and errors with the log tail."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static


class Banner(Static):
    DEFAULT_CSS = """
    Banner { height: auto; max-height: 16; padding: 0 1; display: none; text-wrap: nowrap; text-overflow: ellipsis; }
    Banner.-info { display: block; background: $primary 25%; }
    Banner.-warn { display: block; background: $warning 25%; }
    Banner.-error { display: block; background: $error 25%; border-left: thick $error; }
    """

    def say(self, level: str | None, message: str = "", detail: str = "", keys: str = "") -> None:
        """level: None hides the banner; 'info', 'warn' or 'error' shows it."""
        self.remove_class("-info", "-warn", "-error")
        if level is None:
            self.update("")
            return
        self.add_class(f"-{level}")
        text = Text(no_wrap=True, overflow="ellipsis")
        text.append(message, style="bold")
        if keys:
            text.append("\n" + keys, style="italic")
        if detail:
            text.append("\n" + detail.rstrip(), style="dim" if level != "error" else "")
        self.update(text)
