"""The tier panel by the engine's tier mode: a cache shows its hit rate and its trend (and says when
it is the simulated tier), its swaps, adapt rounds and wait, its hottest experts; every expert resident
says so instead. From the engine's totals, the shares, the hit rate, the swaps, rounds and wait are
those of the last window between two engine reports."""

from __future__ import annotations

import pytest
from test_tui_layout import dashboard_on, first_poll, screen_lines, shown

from tui import preview
from tui.preview import MOE_ROUNDS, MOE_WAIT_MS, moe_window_rate, moe_window_swaps
from tui.view import History, TierWindow, tier_window
from tui.widgets.tier_panel import tier_lines


@pytest.mark.parametrize(("mode", "expect", "absent"), [
    ("simulated", ["hit rate 84.2%", "cached 4,480/6,144", "simulated (no GPU)"], ["every expert resident"]),
    ("resident", ["every expert resident (no cache)"], ["hit rate", "simulated", "swaps", "rounds"]),
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
    one since start, a per-window trend that climbs as the cache warms up, the last window's swaps,
    adapt rounds and wait beside the totals since start, the hottest experts (a miss marked); no
    "every expert resident"."""
    history = History()
    for snap in preview.cpu_moe_history():
        history.push(snap)
    lines = tier_lines(preview.cpu_moe_simulated(), history).plain.splitlines()
    assert lines[0] == ("hit rate 90.0% last 2 s (1,200 lookups), 66.3% since start  cached 24/64  "
                        "simulated (no GPU)")
    assert lines[1].startswith("hit rate trend ") and lines[1].endswith(" (per window)")
    trend = lines[1].removeprefix("hit rate trend ").removesuffix(" (per window)")
    assert len(trend) == 20 and trend == "".join(sorted(trend)) and trend[0] < trend[-1], trend
    assert lines[2:6] == ["last 2 s: swaps 1  adapt rounds 4  adapt wait 1.6 ms",
                          "since start: swaps 61  rounds 124  wait 0.1 ms/window",
                          "hottest (layer/expert, share of its layer's routing)",
                          "L0/E3 31%  L2/E11 27%  L1/E7 22%  L3/E0 19% miss"]
    assert "every expert resident" not in "\n".join(lines)


def test_swaps_and_rounds_per_window_while_the_cache_fills() -> None:
    """Early on (many swaps a window) the window's figures differ from the totals; without totals
    (an older server) or a wait total (an older engine) the panel says only what it knows."""
    history = History()
    for window in range(6):
        history.push(preview.cpu_moe_simulated(window))
    text = tier_lines(preview.cpu_moe_simulated(5), history).plain
    assert "last 2 s: swaps 4  adapt rounds 4  adapt wait 1.6 ms\nsince start: swaps 24  rounds 24  wait 0.0 ms/window" in text
    older = History()
    for window in range(6):
        snap = preview.cpu_moe_simulated(window)
        snap.tier.adapt_wait_total_ms = None
        older.push(snap)
    assert "last 2 s: swaps 4  adapt rounds 4\nsince start" in tier_lines(snap, older).plain
    snap.tier.hits = snap.tier.lookups = None
    snap.tier.hot = []
    text = tier_lines(snap, History()).plain
    assert "last" not in text and "hottest" not in text and "since start: swaps 24  rounds 24" in text


def test_tier_window_from_the_totals() -> None:
    """A window is the difference of two reports' totals; none when nothing was looked up (the last
    window stands), when the totals went back (the engine restarted: the next report starts anew),
    or from a server that sends no totals (the trend is then the rate since start)."""
    first, second, third = (preview.cpu_moe_simulated(w) for w in (3, 4, 5))
    hits = round(1200 * moe_window_rate(4))
    window = tier_window(first.tier, 10.0, second.tier, 12.0)
    assert window == TierWindow(seconds=2.0, lookups=1200, vram_share=hits / 1200, pcie_share=0.0,
                                cpu_share=(1200 - hits) / 1200, swaps=moe_window_swaps(4), adapt_rounds=MOE_ROUNDS,
                                adapt_wait_ms=window.adapt_wait_ms)
    assert window.adapt_wait_ms == pytest.approx(MOE_WAIT_MS)
    assert tier_window(second.tier, 12.0, second.tier, 14.0) is None
    assert tier_window(second.tier, 12.0, first.tier, 14.0) is None  # restarted
    restarted = third.model_copy(deep=True)
    restarted.tier.swaps = 0  # more lookups than before, but the swaps went back: a new engine
    assert tier_window(second.tier, 12.0, restarted.tier, 14.0) is None
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
    app = dashboard_on(preview.cpu_moe_history())
    async with app.run_test(size=(150, 44)) as pilot:
        await first_poll(pilot, app)
        text = "\n".join(screen_lines(app))
    assert "VRAM 90.0%" in text and "CPU 10.0%" in text and "66.3% since start" in text, text
