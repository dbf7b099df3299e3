"""Recording the engine's prompt forwards in tests of how reads are grouped."""

from __future__ import annotations

import pytest

from engine.check import Driver


def forwards(driver: Driver, monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """Each prompt forward's parts, as their sessions, recorded from now on."""
    runner, seen = driver.server.runner, []
    read_parts = runner.read_parts

    def record(parts):
        seen.append([session.index for session, _ in parts])
        return read_parts(parts)

    monkeypatch.setattr(runner, "read_parts", record)
    return seen
