"""`Copier`: an adaptation round's copies on a helper thread (`--adapt-async 1`), so no window waits
for them.

A round evicts its slots at once (the table forgets their experts: their entries are misses from the
next window on), hands the fills to the copier and goes on; the tier publishes the new experts at
the first window boundary after the copies are done. Windows never read a slot between its eviction
and its publication, so a fill writes buffers nothing else touches.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from engine.tier.policy import Swap
from engine.tier.slots import SlotTable


class Copier:
    def __init__(self, tables: list[SlotTable]):
        self._tables = tables  # each layer's, as a round's swaps index them
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tier-copier")
        self._round: Future[None] | None = None
        self._swaps: list[Swap] = []

    @property
    def busy(self) -> bool:
        """A round's copies are queued or running, or done and not yet published."""
        return self._round is not None

    def start(self, swaps: list[Swap]) -> None:
        """Evict the swaps' slots now and fill them on the helper thread."""
        if self._round is not None:
            raise RuntimeError("a round's copies are still in flight")
        for s in swaps:
            self._tables[s.layer].evict(s.slot)
        self._swaps = swaps
        self._round = self._pool.submit(self._fill)

    def _fill(self) -> None:
        for s in self._swaps:
            self._tables[s.layer].fill(s.slot, s.expert)

    def publish_ready(self) -> int:
        """Publish the round's experts if its copies are done; the swaps published (0: none ready)."""
        if self._round is None or not self._round.done():
            return 0
        return self._publish()

    def finish(self) -> int:
        """Wait for the round's copies (at quit, or where a caller must see a settled cache) and publish them."""
        return 0 if self._round is None else self._publish()

    def _publish(self) -> int:
        round_, self._round = self._round, None
        round_.result()  # waits where the copies run on; a copy that failed raises here, on the tier's thread
        for s in self._swaps:
            self._tables[s.layer].publish(s.slot, s.expert)
        n, self._swaps = len(self._swaps), []
        return n
