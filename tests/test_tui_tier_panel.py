"""The tier panel by the engine's tier mode: a cache shows its hit rate and its trend (and says when
it is the simulated tier); every expert resident says so instead of a hit rate."""

from __future__ import annotations

import pytest
from test_tui_layout import shown

from tui import preview
from tui.view import History
from tui.widgets.tier_panel import tier_lines


@pytest.mark.parametrize(("mode", "expect", "absent"), [
    ("simulated", ["hit rate 84.2%", "cached 4,480/6,144", "simulated (no GPU)"], ["every expert resident"]),
    ("resident", ["every expert resident (no cache)"], ["hit rate", "simulated"]),
])
async def test_tier_panel_follows_the_tier_mode(mode, expect, absent) -> None:
    snap = preview.busy()
    snap.tier.mode = mode
    _, lines = await shown(snap, (150, 44))
    text = "\n".join(lines)
    assert all(e in text for e in expect), text
    assert not any(a in text for a in absent)


def test_tier_lines_show_the_simulated_cache_warming_up() -> None:
    """The panel's text from the fixed simulated-tier preview: the hit rate, a trend that climbs as
    the history does, swaps, adapt rounds and wait; no "every expert resident"."""
    history = History()
    for snap in preview.cpu_moe_history():
        history.push(snap)
    lines = tier_lines(preview.cpu_moe_simulated(), history).plain.splitlines()
    assert lines[0] == "hit rate 71.3%  cached 24/64  simulated (no GPU)"
    assert lines[1].startswith("hit rate trend ") and lines[1].endswith(" (since start)")
    trend = lines[1].removeprefix("hit rate trend ").removesuffix(" (since start)")
    assert len(trend) == 20 and trend == "".join(sorted(trend)) and trend[0] < trend[-1], trend
    assert lines[2] == "swaps 57  adapt rounds 31  adapt wait 0.8 ms"
    assert "every expert resident" not in "\n".join(lines)


def test_resident_tier_keeps_no_hit_rate_trend() -> None:
    snap = preview.cpu_moe_simulated()
    assert snap.tier is not None
    snap.tier.mode = "resident"
    history = History()
    history.push(snap)
    assert not history.hit_rate
    text = tier_lines(snap, history).plain
    assert text.startswith("every expert resident (no cache)") and "trend" not in text and "hit rate" not in text
