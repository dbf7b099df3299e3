"""Updating a Static without needless work. Textual reflows the whole screen on every
`Static.update` (that was most of the dashboard's CPU at a 1 Hz refresh), so `update_text` updates only
when the content changed, and asks for a layout pass only when its shape (the lines and their
lengths) changed too: the same shape takes the same room."""

from __future__ import annotations

from weakref import WeakKeyDictionary

from rich.text import Text
from textual.widgets import Static

_shown: WeakKeyDictionary[Static, str | Text] = WeakKeyDictionary()


def _shape(content: str | Text) -> list[int]:
    plain = content.plain if isinstance(content, Text) else content
    return [len(line) for line in plain.split("\n")]


def update_text(widget: Static, content: str | Text) -> None:
    old = _shown.get(widget)
    if old is not None and old == content:
        return
    _shown[widget] = content
    widget.update(content, layout=old is None or _shape(old) != _shape(content))
