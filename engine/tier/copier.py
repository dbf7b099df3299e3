"""`Copier`: an adaptation round's copies on a helper thread (`--adapt-async 1`), so no window waits
for them.

A round evicts its slots at once (the table forgets their experts: their entries are misses from the
next window on), hands the fills to the copier and goes on; the tier publishes the new experts at
the first window boundary after the copies are done. Windows never read a slot between its eviction
and its publication, so a fill writes buffers nothing else touches.

Slots on a CUDA device (the GPU tier) are filled on a copy stream of that device's own: its copies
wait on the GPU (not the host) for the windows already queued on the compute stream, which may still
read the evicted slots, and are done when an event after them has passed; only then are the
experts published, so no window queued later reads a slot before its copy.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from engine.tier.policy import Swap
from engine.tier.slots import SlotTable


class Copier:
    def __init__(self, tables: list[SlotTable]):
        self._tables = tables  # each layer's, as a round's swaps index them
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tier-copier")
        self._round: Future[None] | None = None
        self._swaps: list[Swap] = []
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._queued: dict[torch.device, torch.cuda.Event] = {}  # on the compute streams, at the round's start
        self._copied: list[torch.cuda.Event] = []  # on the copy streams, after the round's copies

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
        self._queued = {}
        for d in {_cuda(self._tables[s.layer]) for s in swaps} - {None}:
            self._queued[d] = torch.cuda.current_stream(d).record_event()
        self._round = self._pool.submit(self._fill)

    def _fill(self) -> None:
        copied = []
        for d, queued in self._queued.items():
            stream = self._streams.setdefault(d, torch.cuda.Stream(d))
            stream.wait_event(queued)
            with torch.cuda.stream(stream):
                for s in self._swaps:
                    if _cuda(self._tables[s.layer]) == d:
                        self._tables[s.layer].fill(s.slot, s.expert)
            copied.append(stream.record_event())
        for s in self._swaps:
            if _cuda(self._tables[s.layer]) is None:
                self._tables[s.layer].fill(s.slot, s.expert)
        self._copied = copied

    def publish_ready(self) -> int:
        """Publish the round's experts if its copies are done; the swaps published (0: none ready)."""
        if self._round is None or not self._round.done() or not all(e.query() for e in self._copied):
            return 0
        return self._publish()

    def finish(self) -> int:
        """Wait for the round's copies (at quit, or where a caller must see a settled cache) and publish them."""
        return 0 if self._round is None else self._publish()

    def _publish(self) -> int:
        round_, self._round = self._round, None
        round_.result()  # waits where the copies run on; a copy that failed raises here, on the tier's thread
        for e in self._copied:
            e.synchronize()
        for s in self._swaps:
            self._tables[s.layer].publish(s.slot, s.expert)
        n, self._swaps = len(self._swaps), []
        return n


def _cuda(table: SlotTable) -> torch.device | None:
    """The CUDA device a table's slots are on (the GPU tier's), else None."""
    device = getattr(table, "device", None)
    return device if device is not None and device.type == "cuda" else None
