"""SVG snapshots of the dashboard from fixed metrics (tui.preview): idle at 80x24, busy with four
slots, and an engine in error. One poll only (a long poll interval) and fixed times, so every run
draws the same screen. Update with `pytest tests/test_tui_snapshots.py --snapshot-update`."""

from __future__ import annotations

import pytest

pytest.importorskip("pytest_textual_snapshot")

from textual.pilot import Pilot  # noqa: E402

from server.metrics_schema import MetricsSnapshot  # noqa: E402
from tui import preview  # noqa: E402
from tui.app import StrataDeskApp  # noqa: E402
from tui.client import FixedSource  # noqa: E402


def make_app(snapshot: MetricsSnapshot, history: list[MetricsSnapshot] | None = None) -> StrataDeskApp:
    app = StrataDeskApp(attach_url="http://127.0.0.1:8080", source=FixedSource(snapshot), poll_interval=3600)
    for past in history or []:
        app.history.push(past)
    return app


async def first_poll(pilot: Pilot) -> None:
    app = pilot.app
    assert isinstance(app, StrataDeskApp)
    for _ in range(100):
        if app.snapshot is not None:
            break
        await pilot.pause(0.05)
    await pilot.pause()
    app.screen.set_focus(None)
    await pilot.pause()


def test_dashboard_idle_80x24(snap_compare) -> None:
    assert snap_compare(make_app(preview.idle()), terminal_size=(80, 24), run_before=first_poll)


def test_dashboard_busy_four_slots(snap_compare) -> None:
    history = preview.busy_history()
    assert snap_compare(make_app(history[-1], history[:-1]), terminal_size=(150, 44), run_before=first_poll)


def test_dashboard_engine_error(snap_compare) -> None:
    assert snap_compare(make_app(preview.dead()), terminal_size=(120, 36), run_before=first_poll)


def test_dashboard_no_gpu_dense(snap_compare) -> None:
    assert snap_compare(make_app(preview.cpu_dense()), terminal_size=(120, 36), run_before=first_poll)


def test_dashboard_cpu_simulated_tier(snap_compare) -> None:
    history = preview.cpu_moe_history()
    assert snap_compare(make_app(history[-1], history[:-1]), terminal_size=(120, 36), run_before=first_poll)
