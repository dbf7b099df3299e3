"""Conversation parking: a session's conversation kept in host memory when its session is taken.

When a read is about to overwrite a session that holds another conversation (a slot given to
another request, the solo session taking a new one), `Runner.reuse` parks that conversation here:
its tokens and a host copy of its KV rows (pinned on CUDA; on the CPU a copy all the same, since the
session's rows are overwritten next). A later read that continues a parked conversation gets it
back into its own session (`restore`) and reads only its new tokens, as if it had stayed live.

The store keeps conversations least-recently-used within `max_bytes` and `max_entries`
(`--conversation-cache-mib`, `--conversation-cache-slots`). A parked ring (sliding-window layers)
is kept as it was, so what it can continue is what it could have continued live (`KVCache.usable_prefix`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.kv import KVCache
from engine.loading import log
from engine.memory import MIB, free_bytes

# parking never takes host RAM below this (the weights, the server and the OS need it more)
MIN_FREE_BYTES = 1024 * MIB


class CopyTimer:
    """How long copies queued on the CUDA devices `devices` take, read once they are done, so the host never waits
    for them (the caller's stream orders what comes after); with no CUDA device, the host's time of the copies."""

    def __init__(self, devices: list[torch.device]):
        self.t0 = time.perf_counter()
        self.host_ms: float | None = None
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event, torch.device]] = []
        for device in devices:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(torch.cuda.current_stream(device))
            self.events.append((start, end, device))

    def stop(self) -> CopyTimer:
        """After the copies are queued."""
        for _, end, device in self.events:
            end.record(torch.cuda.current_stream(device))
        if not self.events:
            self.host_ms = (time.perf_counter() - self.t0) * 1000
        return self

    def ms(self) -> float | None:
        """The copies' milliseconds (the slowest device's), None while they run."""
        if not self.events:
            return self.host_ms
        if not all(end.query() for _, end, _ in self.events):
            return None
        return max(start.elapsed_time(end) for start, end, _ in self.events)


@dataclass(eq=False)
class Parked:
    """One parked conversation: `tokens` with their KV (`KVCache.save`), `turn` = where its last
    request's prompt ended (a later prompt that holds all of it continues the conversation)."""

    tokens: list[int]
    turn: int
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    bytes: int = field(init=False)  # counted once: the store sums its entries' on every park and eviction

    def __post_init__(self) -> None:
        self.bytes = sum(t.numel() * t.element_size() for t in self.k + self.v)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def continues(tokens: list[int], turn: int, prompt: list[int]) -> bool:
    """Whether `prompt` goes on with the conversation held as `tokens`: it holds every token up to the
    turn checkpoint (the end of the last prompt), so a client that dropped the reply (or its thinking)
    from the history still continues it."""
    return bool(tokens) and common_prefix(tokens, prompt) >= min(turn, len(tokens))


class ParkingStore:
    """Parked conversations, least recently used first, within `max_bytes` and `max_entries`."""

    def __init__(self, max_bytes: int, max_entries: int, pin: bool):
        if max_bytes < 0 or max_entries < 0:
            raise ValueError("the conversation cache limits must be >= 0")
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.pin = pin
        self.entries: list[Parked] = []  # least recently used first
        self.parks = self.evictions = self.skipped = 0
        self.lookups = self.restores = 0
        self.restore_ms_last = self.restore_ms_total = 0.0
        self.timed = 0  # restores whose copies' time is in the figures
        self.timing: list[CopyTimer] = []  # restores whose copies may still run, oldest first

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0 and self.max_entries > 0

    @property
    def bytes(self) -> int:
        return sum(e.bytes for e in self.entries)

    def best(self, usable: Callable[[list[int]], int]) -> tuple[Parked | None, int]:
        """The parked conversation a read can continue furthest (`usable(tokens)`), and how far.
        Counts a lookup when anything is parked."""
        if not self.entries:
            return None, 0
        self.lookups += 1
        best, best_n = None, 0
        for entry in self.entries:
            n = usable(entry.tokens)
            if n > best_n:
                best, best_n = entry, n
        return best, best_n

    def park(self, kv: KVCache, session: int, tokens: list[int], turn: int) -> None:
        """Copy session `session`'s conversation out: first the parked prefixes of it and the least recently used
        until it fits are dropped."""
        if not self.enabled or not tokens:
            return
        shared = [common_prefix(e.tokens, tokens) for e in self.entries]
        if len(tokens) in shared:
            return  # already parked, whole
        need = kv.saved_bytes(len(tokens))
        if not self._room_for(need):
            self.skipped += 1
            log(f"parking: skipped {len(tokens)} tokens (over {self.max_bytes // MIB} MiB, or host RAM low)")
            return
        t0 = time.perf_counter()
        superseded = [e for e, n in zip(self.entries, shared, strict=True) if n == len(e.tokens)]
        for e in superseded:
            self.entries.remove(e)
        # room made before the copy is allocated: never an entry over the limits in memory, and a dropped entry's
        # pinned block can be handed out again (torch's host cache keeps freed blocks by power-of-two size) where a
        # new one takes ~10 ms of host time (16 MiB, an H100)
        self._make_room(need)
        self.entries.append(Parked(list(tokens), turn, *kv.save(session, len(tokens), self.pin)))
        self.parks += 1
        log(f"parking: parked {len(tokens)} tokens in {(time.perf_counter() - t0) * 1000:.1f} ms; "
            f"parked={len(self.entries)} bytes={self.bytes} evictions={self.evictions}"
            + (f" superseded={len(superseded)}" if superseded else ""))

    def put(self, entry: Parked) -> None:
        """Add `entry` as the most recently used, dropping the least recently used until it fits."""
        self._make_room(entry.bytes)
        self.entries.append(entry)

    def _make_room(self, need: int) -> None:
        """Drop the least recently used until one more entry of `need` bytes fits."""
        while self.entries and (len(self.entries) >= self.max_entries or self.bytes + need > self.max_bytes):
            self.entries.pop(0)
            self.evictions += 1

    def _room_for(self, need: int) -> bool:
        return need <= self.max_bytes and free_bytes(torch.device("cpu"))[0] - need >= MIN_FREE_BYTES

    def take(self, entry: Parked) -> None:
        """Take `entry` out before a read restores it (so parking the read's session cannot drop it)."""
        self.entries.remove(entry)

    def restore(self, entry: Parked, kv: KVCache, session: int, n: int) -> None:
        """Write the first `n` positions of a `take`n entry into session `session`: the copies queued, the host not
        waiting for them (the read after them is queued behind them); their time comes into the figures once
        they are done (`settle`)."""
        timer = CopyTimer(sorted({t.device for t in kv.k if t.device.type == "cuda"}, key=str))
        kv.load(session, entry.k, entry.v, n)
        self.timing.append(timer.stop())
        self.restores += 1
        log(f"parking: restored {n} of {len(entry.tokens)} tokens; parked={len(self.entries)} bytes={self.bytes}")

    def settle(self) -> None:
        """Count the time of the restores whose copies are done, in order."""
        while self.timing and (ms := self.timing[0].ms()) is not None:
            self.timing.pop(0)
            self.timed += 1
            self.restore_ms_last = ms
            self.restore_ms_total += ms

    def stats(self) -> dict:
        """The `parking` object of STATS (docs/protocol.md)."""
        self.settle()
        return {"parked": len(self.entries), "bytes": self.bytes, "parks": self.parks,
                "evictions": self.evictions, "skipped": self.skipped, "lookups": self.lookups,
                "restores": self.restores, "restore_ms": round(self.restore_ms_last, 2),
                "restore_ms_mean": round(self.restore_ms_total / self.timed, 2) if self.timed else 0.0}
