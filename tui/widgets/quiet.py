"""Updating a Static without needless work. Textual reflows the whole screen for a Static update that
asks for layout (that was most of the dashboard's CPU at a 1 Hz refresh), so `update_text` updates only
when the content changed, and asks for a layout pass only when the widget's size may change with it:
a different number of lines, a line too long for its width (it wraps), or any other change of
line lengths in a widget whose width follows its content (`width: auto`)."""

from __future__ import annotations

from weakref import WeakKeyDictionary

from rich.cells import cell_len
from rich.text import Text
from textual.widgets import Static

_shown: WeakKeyDictionary[Static, str | Text] = WeakKeyDictionary()


def _shape(content: str | Text) -> list[int]:
    plain = content.plain if isinstance(content, Text) else content
    return [cell_len(line) for line in plain.split("\n")]


def needs_layout(widget: Static, old: str | Text | None, new: str | Text) -> bool:
    """Whether showing `new` instead of `old` may change the widget's size."""
    if old is None:
        return True
    before, after = _shape(old), _shape(new)
    if before == after:
        return False
    width = widget.styles.width
    if len(before) != len(after) or (width is not None and width.is_auto):
        return True
    room = widget.content_size.width
    return room <= 0 or max(before) > room or max(after) > room


def update_text(widget: Static, content: str | Text) -> None:
    old = _shown.get(widget)
    if old is not None and old == content:
        return
    _shown[widget] = content
    widget.update(content, layout=needs_layout(widget, old, content))
