"""Conversation parking: a session's conversation kept in host memory when its session is taken.

When a read is about to overwrite a session that holds another conversation (a slot given to
another request, the solo session taking a new one), `Runner.reuse` parks that conversation here:
its tokens and a host copy of its KV rows (pinned on CUDA; on the CPU a copy all the same, since the
session's rows are overwritten next). A later read that continues a parked conversation gets it
back into its own session (`restore`) and reads only its new tokens, as if it had stayed live.

While the engine is idle it takes the copy of a finished conversation ahead (`park_ahead`, on a CUDA stream of
its own), so the park when its session is taken has no copy left to make: a burst's parks are off its read's path.

The store keeps conversations least-recently-used within `max_bytes` and `max_entries`
(`--conversation-cache-mib`, `--conversation-cache-slots`); copies taken ahead count in `max_bytes`. A parked ring
(sliding-window layers) is kept as it was, so what it can continue is what it could have continued live
(`KVCache.usable_prefix`).
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
    if a[:n] == b[:n]:  # compared in C: a conversation against its own copy is the long case
        return n
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
        # copies taken ahead (`park_ahead`) by session, with the event their copy's stream records after it
        self.ready: dict[int, tuple[Parked, torch.cuda.Event | None]] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self.parks = self.evictions = self.skipped = self.ahead = 0
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

    @property
    def ready_bytes(self) -> int:
        return sum(entry.bytes for entry, _ in self.ready.values())

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
        """Keep session `session`'s conversation, which its next read overwrites: its copy taken ahead where there is
        one, else copied now; first the parked prefixes of it and the least recently used until it fits are dropped."""
        ready, copied = self.ready.pop(session, (None, None))
        if not self.enabled or not tokens:
            return
        shared = self._shared(tokens)
        if len(tokens) in shared:
            return  # already parked, whole
        if ready is not None and ready.tokens != tokens:
            ready = None  # the session changed since (a safety net: its reads and copies drop it, `drop_ready`)
        need = ready.bytes if ready is not None else kv.saved_bytes(len(tokens))
        if ready is None and not self._room_for(need):
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
        if ready is None:
            entry = Parked(list(tokens), turn, *kv.save(session, len(tokens), self.pin))
        else:
            entry = ready
            self.ahead += 1
            if copied is not None:  # the read that overwrites the session waits for the copy taken ahead
                torch.cuda.current_stream(copied.device).wait_event(copied)
        self.entries.append(entry)
        self.parks += 1
        log(f"parking: parked {len(tokens)} tokens in {(time.perf_counter() - t0) * 1000:.1f} ms"
            + (" (copied ahead)" if ready is not None else "")
            + f"; parked={len(self.entries)} bytes={self.bytes} evictions={self.evictions}"
            + (f" superseded={len(superseded)}" if superseded else ""))

    def park_ahead(self, kv: KVCache, session: int, tokens: list[int], turn: int) -> bool:
        """While the engine is idle: copy session `session`'s conversation out now, for its `park` when the session is
        taken (the copy is then made; its read does not wait for it on the host), unless it is parked whole already,
        or does not fit beside what is parked (nothing is dropped for a copy that may never be parked: the session's
        next read may continue it, `drop_ready`). On CUDA the copy runs on a stream of its own, so a read of another
        session that comes meanwhile does not queue behind it. Returns whether a copy was taken."""
        if not self.enabled or not tokens or session in self.ready or kv.gpu is None and kv.k[0].is_cuda:
            return False  # a layer split's copies stay on the layers' own streams, at the park
        if len(tokens) in self._shared(tokens):
            return False  # already parked, whole
        need = kv.saved_bytes(len(tokens))
        if self.bytes + self.ready_bytes + need > self.max_bytes or not self._room_for(need):
            return False
        copied = None
        if kv.gpu is None:
            k, v = kv.save(session, len(tokens), self.pin)
        else:
            if kv.gpu not in self._streams:
                self._streams[kv.gpu] = torch.cuda.Stream(kv.gpu)
            stream = self._streams[kv.gpu]
            stream.wait_stream(torch.cuda.current_stream(kv.gpu))  # after the work that wrote the session
            with torch.cuda.stream(stream):
                k, v = kv.save(session, len(tokens), self.pin)
                copied = torch.cuda.Event()
                copied.record(stream)
        self.ready[session] = (Parked(list(tokens), turn, k, v), copied)
        return True

    def drop_ready(self, session: int) -> None:
        """Session `session` is read without being parked (its conversation goes on, or another session holds it):
        the copy taken ahead is dropped (torch keeps its pinned block until the copy is done)."""
        self.ready.pop(session, None)

    def _shared(self, tokens: list[int]) -> list[int]:
        """How many of `tokens` each parked entry shares with them from the start."""
        return [common_prefix(e.tokens, tokens) for e in self.entries]

    def put(self, entry: Parked) -> None:
        """Add `entry` as the most recently used, dropping the least recently used until it fits."""
        self._make_room(entry.bytes)
        self.entries.append(entry)

    def _make_room(self, need: int) -> None:
        """Drop copies taken ahead, then the least recently used, until one more entry of `need` bytes fits."""
        while self.ready and self.bytes + self.ready_bytes + need > self.max_bytes:
            self.ready.pop(next(iter(self.ready)))
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
        return {"parked": len(self.entries), "bytes": self.bytes, "parks": self.parks, "ahead": self.ahead,
                "evictions": self.evictions, "skipped": self.skipped, "lookups": self.lookups,
                "restores": self.restores, "restore_ms": round(self.restore_ms_last, 2),
                "restore_ms_mean": round(self.restore_ms_total / self.timed, 2) if self.timed else 0.0}
