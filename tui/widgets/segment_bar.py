"""A one-line horizontal bar split into coloured segments (VRAM split, tier shares)."""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget


@dataclass(frozen=True)
class Segment:
    label: str
    value: float
    style: str
    char: str = "█"


def split_cells(values: list[float], width: int) -> list[int]:
    """Cells per value summing to `width` (largest remainder; a non-zero value gets >= 1 cell)."""
    total = sum(v for v in values if v > 0)
    if total <= 0 or width <= 0:
        return [0] * len(values)
    raw = [max(0.0, v) / total * width for v in values]
    cells = [int(r) for r in raw]
    for i, v in enumerate(values):
        if v > 0 and cells[i] == 0:
            cells[i] = 1
    while sum(cells) > width:
        i = max(range(len(cells)), key=lambda k: cells[k])
        cells[i] -= 1
    order = sorted(range(len(raw)), key=lambda k: raw[k] - int(raw[k]), reverse=True)
    k = 0
    while sum(cells) < width and order:
        cells[order[k % len(order)]] += 1
        k += 1
    return cells


class SegmentBar(Widget):
    """Draws `segments` across the full width; `empty` is shown when all values are zero."""

    DEFAULT_CSS = """
    SegmentBar { height: 1; width: 1fr; }
    """

    segments: reactive[tuple[Segment, ...]] = reactive(tuple, layout=False)

    def __init__(self, *, empty: str = "no data", name: str | None = None, id: str | None = None,
                 classes: str | None = None) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self.empty = empty

    def render(self) -> Text:
        width = self.size.width
        values = [s.value for s in self.segments]
        if width <= 0 or sum(v for v in values if v > 0) <= 0:
            return Text(self.empty.center(max(0, width)), style="dim")
        text = Text()
        for seg, cells in zip(self.segments, split_cells(values, width), strict=True):
            if cells:
                text.append(seg.char * cells, style=seg.style)
        return text
