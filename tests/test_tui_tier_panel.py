"""The tier panel by the engine's tier mode: a cache shows its hit rate and its trend (and says when
it is the simulated tier); every expert resident says so instead of a hit rate. From the engine's
totals, the shares and the hit rate are those of the last window between two engine reports."""

from __future__ import annotations

import pytest
from test_tui_layout import screen_lines, shown

from tui import preview
from tui.preview import moe_window_rate
from tui.view import History, TierWindow, tier_window
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
    """The panel's text from the fixed simulated-tier preview: the last window's hit rate beside the
    one since start, a per-window trend that climbs as the cache warms up, swaps, adapt rounds and
    wait; no "every expert resident"."""
    history = History()
    for snap in preview.cpu_moe_history():
        history.push(snap)
    lines = tier_lines(preview.cpu_moe_simulated(), history).plain.splitlines()
    assert lines[0] == ("hit rate 90.0% last 2 s (1,200 lookups), 66.3% since start  cached 24/64  "
                        "simulated (no GPU)")
    assert lines[1].startswith("hit rate trend ") and lines[1].endswith(" (per window)")
    trend = lines[1].removeprefix("hit rate trend ").removesuffix(" (per window)")
    assert len(trend) == 20 and trend == "".join(sorted(trend)) and trend[0] < trend[-1], trend
    assert lines[2] == "swaps 57  adapt rounds 31  adapt wait 0.8 ms"
    assert "every expert resident" not in "\n".join(lines)


def test_tier_window_from_the_totals() -> None:
    """A window is the difference of two reports' totals; none when nothing was looked up (the last
    window stands), when the totals went back (the engine restarted: the next report starts anew),
    or from a server that sends no totals (the trend is then the rate since start)."""
    first, second, third = (preview.cpu_moe_simulated(w) for w in (3, 4, 5))
    hits = round(1200 * moe_window_rate(4))
    assert tier_window(first.tier, 10.0, second.tier, 12.0) == TierWindow(
        seconds=2.0, lookups=1200, vram_share=hits / 1200, pcie_share=0.0, cpu_share=(1200 - hits) / 1200)
    assert tier_window(second.tier, 12.0, second.tier, 14.0) is None
    assert tier_window(second.tier, 12.0, first.tier, 14.0) is None  # restarted
    history = History()
    for snap in (first, second, second):
        history.push(snap)
    assert history.tier_window is not None and history.tier_window.vram_share == pytest.approx(moe_window_rate(4), abs=1e-3)
    assert len(history.hit_rate) == 1
    history.push(first)  # the engine restarted: no window, a new base
    history.push(third)
    assert len(history.hit_rate) == 2 and history.tier_window.lookups == 2400
    older = History()
    for snap in (first, second):
        snap.tier.hits = snap.tier.lookups = None
        older.push(snap)
    assert older.tier_window is None and list(older.hit_rate) == [first.tier.hit_rate, second.tier.hit_rate]


async def test_tier_bar_shows_the_last_window() -> None:
    from tui.app import StrataDeskApp
    from tui.client import FixedSource

    history = preview.cpu_moe_history()
    app = StrataDeskApp(attach_url="http://127.0.0.1:8080", source=FixedSource(history[-1]), poll_interval=3600)
    for past in history[:-1]:
        app.history.push(past)
    async with app.run_test(size=(150, 44)) as pilot:
        while app.snapshot is None:
            await pilot.pause(0.05)
        await pilot.pause(0.2)
        text = "\n".join(screen_lines(app))
    assert "VRAM 90.0%" in text and "CPU 10.0%" in text and "66.3% since start" in text, text
