"""Parked conversations on the dashboard: the slots panel says how many are parked now, their host
RAM, and how many were restored since start (`/metrics` `parking`); nothing while parking is off or
has done nothing."""

from __future__ import annotations

from test_tui_layout import shown

from server.metrics_schema import ParkingView
from tui import preview
from tui.widgets.slots_panel import parking_note


def test_parking_note() -> None:
    assert parking_note(None) == ""
    assert parking_note(ParkingView(limit_mib=2048, limit_slots=16)) == ""  # on, nothing parked yet
    assert parking_note(ParkingView(parked=2, parked_mib=768.0)) == "2 parked (768 MiB host RAM)"
    assert parking_note(ParkingView(parked=1, parked_mib=1536.0, restores=3, restore_ms_mean=41.4)) == (
        "1 parked (1.5 GiB host RAM), 3 restored (mean 41 ms)")
    assert parking_note(ParkingView(restores=2)) == "0 parked (0 MiB host RAM), 2 restored"


async def test_slots_panel_shows_parking() -> None:
    snap = preview.busy()
    snap.parking = ParkingView(parked=2, parked_mib=768.0, restores=3, restore_ms_mean=41.4, limit_mib=2048)
    _, lines = await shown(snap, (150, 44))
    assert "2 parked (768 MiB host RAM), 3 restored (mean 41 ms)" in "\n".join(lines)
