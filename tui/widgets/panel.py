"""The bordered box every dashboard panel sits in (title in the border, toggled by a digit)."""

from __future__ import annotations

from textual.containers import Vertical

from server.metrics_schema import MetricsSnapshot
from tui.view import History


class Panel(Vertical):
    """A titled box. Subclasses fill it and implement `show(snapshot, history)`."""

    DEFAULT_CSS = """
    Panel {
        border: round $primary 60%;
        border-title-color: $text;
        border-title-style: bold;
        border-subtitle-color: $text-muted;
        height: auto;
        padding: 0 1;
    }
    Panel:focus-within { border: round $accent; }
    """

    def __init__(self, title: str, key: str, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.key = key
        self.base_title = title
        self._title = f"{key} {title}"
        self._subtitle = ""
        self.border_title = f"{key} {title}"

    # Setting a border title or subtitle repaints the whole panel, children included, even when it
    # is the same text: set only changes.
    def set_title(self, text: str) -> None:
        title = f"{self.key} {text}"
        if title != self._title:
            self._title = title
            self.border_title = title

    def set_subtitle(self, text: str) -> None:
        if text != self._subtitle:
            self._subtitle = text
            self.border_subtitle = text

    def show(self, snapshot: MetricsSnapshot, history: History) -> None:
        """Draw `snapshot` (and the series in `history`); every panel draws its own part."""
        raise NotImplementedError(f"{type(self).__name__} must implement show")
