"""The dashboard's layout on fixed data (tui.preview) with Pilot: what a narrow and a mid-size
terminal show of the header, the log and the figures."""

from __future__ import annotations

import html
import re

from tui import preview
from tui.app import StrataDeskApp
from tui.client import FixedSource
from tui.widgets.header_bar import HeaderInfo, right_parts
from tui.widgets.log_panel import LogPanel


def screen_lines(app: StrataDeskApp) -> list[str]:
    svg = re.sub(r"<style.*?</style>", "", app.export_screenshot(), flags=re.S)
    text = html.unescape(re.sub(r"<[^>]+>", "", svg)).replace("\xa0", " ")
    return [line for line in text.splitlines() if line.strip()]


def dashboard_on(snapshots: list) -> StrataDeskApp:
    """A dashboard attached to a server that always answers the last snapshot, the ones before it
    already in its history."""
    app = StrataDeskApp(attach_url="http://127.0.0.1:8080", source=FixedSource(snapshots[-1]), poll_interval=3600)
    for past in snapshots[:-1]:
        app.history.push(past)
    return app


async def first_poll(pilot, app: StrataDeskApp) -> None:
    """Until the first snapshot is in and drawn."""
    while app.snapshot is None:
        await pilot.pause(0.05)
    await pilot.pause(0.2)


async def shown(snapshot, size: tuple[int, int], log: bool = False) -> tuple[int, list[str]]:
    """(the log panel's width, the screen's lines)"""
    app = dashboard_on([snapshot])
    if log:
        for source, text in preview.SAMPLE_LOG:
            app.logbuf.add(source, text)
    async with app.run_test(size=size) as pilot:
        await first_poll(pilot, app)
        return app.dashboard.query_one(LogPanel).size.width, screen_lines(app)


async def test_header_at_80x24_keeps_state_and_activity() -> None:
    _, lines = await shown(preview.busy(), (80, 24))
    header = lines[1]
    assert " busy " in header and "answering" in header and "…" not in header, header


def test_right_parts_drop_the_least_needed_first() -> None:
    info = HeaderInfo(uptime_s=600, version="0.1.0", key=True, restarts=2)
    assert [str(t) for t in right_parts(info, 200)] == ["engine restarted 2x", "API key on", "up 10m00s",
                                                         "engine 0.1.0"]
    assert [str(t) for t in right_parts(info, 36)] == ["engine restarted 2x", "API key on"]
    assert right_parts(info, 0) == []


async def test_log_at_120x40_is_full_width_with_times() -> None:
    width, lines = await shown(preview.busy(), (120, 40), log=True)
    assert width >= 110  # not the 46 columns beside the requests
    text = " ".join(line.strip("│ ") for line in lines)  # a long line wraps: nothing is cut
    assert "12:31:30 server 200 POST /v1/chat/completions from 192.168.1.20" in text
    assert "out 412 (72.3 tok/s, stop, solo)" in text
    assert "12:31:41 server 401 POST /v1/chat/completions" in text


async def test_figures_say_their_window_and_ago_counts_from_the_end() -> None:
    _, lines = await shown(preview.busy(), (150, 44))
    text = "\n".join(lines)
    assert "tok/s generated, all requests, last 10 s" in text
    assert "per request 71.4 tok/s" in text
    # r12 arrived 14 s before "now" and took 6.2 s: it ended 7.8 s ago
    assert re.search(r"7\.8s\s+1,834\s+1,620", text), text


async def test_a_poll_repaints_only_the_figures_that_changed(monkeypatch) -> None:
    """Every Static.update and every footer rebuild reflowed the whole screen, and each poll repainted
    the whole dashboard (a message to a screen under it, the panels' border titles set again, the
    digits updated with the same value): only the changed widgets may be repainted, and a figure
    that changes length but still fits its line asks for no layout pass."""
    from textual.screen import Screen
    from textual.widget import Widget

    from tui.widgets.panel import Panel

    snaps = []
    for i in range(60):  # idle: only the uptime and the host's CPU move
        snap = preview.idle()
        snap.uptime_s += i
        snap.host.cpu_pct = 100.0 if i % 2 else 4.0
        snaps.append(snap)
    painted: list[str] = []
    layouts: list[str] = []
    refresh = Widget.refresh

    def spy(self, *regions, layout: bool = False, recompose: bool = False, **kwargs):
        if layout or recompose:
            layouts.append(type(self).__name__)
        elif isinstance(self, Screen | Panel):
            painted.append(type(self).__name__)
        return refresh(self, *regions, layout=layout, recompose=recompose, **kwargs)

    app = StrataDeskApp(attach_url="http://127.0.0.1:8080", source=FixedSource(*snaps), poll_interval=0.1)
    async with app.run_test(size=(160, 44)) as pilot:  # the host line fits: no wrap
        while app.snapshot is None:
            await pilot.pause(0.05)
        monkeypatch.setattr(Widget, "refresh", spy)
        for _ in range(20):  # the first polls mount the cards and lay out: wait (a loaded machine is slow) for a quiet 0.5 s
            painted.clear()
            layouts.clear()
            await pilot.pause(0.5)
            if not painted and not layouts:
                break
        painted.clear()
        layouts.clear()
        uptime = app.snapshot.uptime_s
        await pilot.pause(1.0)
        assert app.snapshot.uptime_s > uptime + 3  # it did poll meanwhile
        assert painted == [] and layouts == []


async def test_throughput_sparkline_follows_the_width() -> None:
    """The sparkline fills its panel (the whole width below 118 columns): a wider terminal draws it
    again at the new width without waiting for the next poll."""
    from textual.widgets import Static

    app = dashboard_on(preview.busy_history())
    async with app.run_test(size=(80, 40)) as pilot:
        await first_poll(pilot, app)
        spark = app.dashboard.query_one("#tp-spark", Static)
        narrow = len(str(spark.render()).splitlines()[0])
        await pilot.resize_terminal(110, 40)
        await pilot.pause(0.3)
        wide = len(str(spark.render()).splitlines()[0])
        assert wide == spark.content_size.width > narrow, (narrow, wide)
