"""The tier panel by the engine's tier mode: a cache shows its hit rate (and says when it is the
simulated tier); every expert resident says so instead of a hit rate."""

from __future__ import annotations

import pytest
from test_tui_layout import shown

from tui import preview


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
