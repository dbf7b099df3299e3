"""Small pure formatting helpers shared by the widgets (no Textual imports)."""

from __future__ import annotations

from collections.abc import Sequence

BLOCKS = "▁▂▃▄▅▆▇█"


def spark(values: Sequence[float], width: int = 12, top: float | None = None) -> str:
    """A one-line text sparkline of the last `width` values (blank cells for missing ones)."""
    tail = list(values)[-width:]
    if not tail:
        return " " * width
    peak = top if top is not None else max(tail)
    if peak <= 0:
        chars = "".join(BLOCKS[0] for _ in tail)
    else:
        chars = "".join(BLOCKS[min(len(BLOCKS) - 1, int(v / peak * (len(BLOCKS) - 1) + 0.5))] for v in tail)
    return chars.rjust(width)


def duration(seconds: float | None) -> str:
    """1.2s, 42s, 3m05s, 2h03m, 3d04h."""
    if seconds is None:
        return "-"
    s = max(0.0, float(seconds))
    if s < 10:
        return f"{s:.1f}s"
    if s < 60:
        return f"{s:.0f}s"
    m, sec = divmod(int(s), 60)
    if m < 60:
        return f"{m}m{sec:02d}s"
    h, m = divmod(m, 60)
    if h < 24:
        return f"{h}h{m:02d}m"
    d, h = divmod(h, 24)
    return f"{d}d{h:02d}h"


def rate(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 1000:
        return f"{value:,.0f}"
    if value >= 100:
        return f"{value:.0f}"
    return f"{value:.1f}"


def count(value: int | None) -> str:
    if value is None:
        return "-"
    if value >= 100_000:
        return f"{value / 1000:.0f}k"
    return f"{value:,}"


def mib(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 1024:
        return f"{value / 1024:.1f} GiB"
    return f"{value:.0f} MiB"


def pct(share: float | None, digits: int = 0) -> str:
    if share is None:
        return "-"
    return f"{share * 100:.{digits}f}%"


def spark_rows(values: Sequence[float], width: int, height: int = 2, top: float | None = None) -> list[str]:
    """A sparkline `height` rows tall (top row first), the last `width` values right-aligned."""
    tail = list(values)[-width:] if width > 0 else []
    peak = top if top is not None else (max(tail) if tail else 0.0)
    levels = [0 if peak <= 0 else round(max(0.0, v) / peak * height * 8) for v in tail]
    rows = []
    for r in range(height - 1, -1, -1):
        row = ""
        for level in levels:
            part = min(8, max(0, level - r * 8))
            row += " " if part == 0 else BLOCKS[part - 1]
        rows.append(row.rjust(width))
    if tail and all(level == 0 for level in levels):
        rows[-1] = (BLOCKS[0] * len(tail)).rjust(width)  # a flat line at zero, not nothing
    return rows
