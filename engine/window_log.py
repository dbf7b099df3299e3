"""The periodic `strata batch:` line in the engine's log (upstream's window line): the decode windows
since the last line, their rows and time, where their routed experts were served, and the expert
tier's adaptation in that time."""

from __future__ import annotations

import time
from collections.abc import Callable

from engine.experts import ExpertStats

EVERY_S = 30.0


class WindowLog:
    def __init__(self, every_s: float = EVERY_S, clock: Callable[[], float] = time.monotonic):
        self.every_s = every_s
        self.clock = clock
        self._reset(rounds=0, swaps=0, wait_s=0.0)

    def _reset(self, rounds: int, swaps: int, wait_s: float) -> None:
        self.since = self.clock()
        self.windows = self.rows = 0
        self.seconds = 0.0
        self.experts = ExpertStats()
        self.tier_at = (rounds, swaps, wait_s)

    def window(self, rows: int, seconds: float, experts: ExpertStats,
               tier: tuple[int, int, float] | None = None) -> str | None:
        """Count a decode window (`tier`: the tier's rounds, swaps and adapt wait so far); the line to log
        when `every_s` have passed since the last one, else None."""
        self.windows += 1
        self.rows += rows
        self.seconds += seconds
        self.experts += experts
        if self.clock() - self.since < self.every_s:
            return None
        w, e = self.windows, self.experts
        line = (f"strata batch: {w} windows, {self.rows} rows in {self.seconds * 1000:.0f} ms = "
                f"{self.rows / max(self.seconds, 1e-9):.1f} rows/s ({self.rows / w:.1f} rows, "
                f"{self.seconds * 1000 / w:.1f} ms a window)")
        if e.lookups:
            line += (f"; routed experts a window: {e.vram / w:.1f} VRAM, {e.pcie / w:.1f} PCIe, {e.cpu / w:.1f} CPU "
                     f"({e.cpu_us / 1000 / w:.2f} ms of CPU)")
        now = tier or (0, 0, 0.0)
        if tier is not None:
            rounds, swaps, wait_s = (a - b for a, b in zip(now, self.tier_at, strict=True))
            line += f"; adaptation: {rounds} rounds, {swaps} swaps, {wait_s * 1000:.1f} ms waited"
        self._reset(*now)
        return line
