"""The protocol loop `EngineLoop`: commands from stdin, prompt reads and decode steps, replies on stdout.

One main thread does all model work; a reader thread only queues stdin lines, so STOP, BSTOP and
BYIELD are seen between chunks and steps. A GEN's prompt is read alone; admissions (BGEN) sent one
after another are read together outside exact mode: each forward takes up to `prefill` prompt tokens,
the earliest admission's first (`_parts`), and each admission's control lines wait until those of the
admissions sent before it are written (`say`, `order`). Between `HOLD` and `GO` admissions are only made
ready (`prepare`: their slots' conversations parked, their prefixes found) while the rest of a burst reaches the
server; while nothing is asked, the parks those reads would make are copied ahead (`Runner.park_ahead`). After each
forward the decoding rows get `decode_share` times its time, so a long prompt slows the others
instead of stopping them; reads whose commands came during the forward start first (`admit_arrivals`).
docs/protocol.md is the contract (where a decode step is called a window, as in STATS `windows`).
"""

from __future__ import annotations

import queue
import random
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TextIO

from engine import protocol as P
from engine.experts import ExpertStats
from engine.loading import log
from engine.memory import memory_split
from engine.models.base import Model
from engine.parking import ParkingStore
from engine.runner import AHEAD, Queued, Row, Runner, Session
from engine.sampling import Draw, logprob_of
from engine.window_log import WindowLog

STATS_INTERVAL_S = 0.25
HOLD_LIMIT_S = 0.25  # a HOLD whose GO never comes ends by itself: held reads are delayed, never stalled


@dataclass
class Job:
    """One GEN (slot None) or BGEN request, from its read to its last token."""

    slot: int | None
    session: Session
    prompt: list[int]
    max_new: int
    sampling: P.Sampling
    seed: int
    reused: int = 0
    read_start: int = 0
    generated: int = 0
    slot_tokens: int = 0
    next_token: int = -1
    started: float = field(default_factory=time.perf_counter)
    prompt_ms: float = 0.0
    decode_started: float = 0.0
    stop: bool = False
    yield_to: int | None = None
    experts: ExpertStats = field(default_factory=ExpertStats)  # routed entries of its decode steps
    prompt_read: int = 0  # prompt tokens actually read (fewer than the prompt after a cancel or a yield)
    held: list[P.Reply] = field(default_factory=list)  # control lines waiting for an earlier admission's (`say`)
    then: list[P.Reply] = field(default_factory=list)  # ERR lines of later commands, written after its own
    closed: bool = False  # its control lines are all said (an admission's BADM)
    prepared: bool = False  # its session was made ready for its read (`EngineLoop.prepare`)

    @property
    def read_pos(self) -> int:
        return len(self.session.tokens)


class EngineLoop:
    def __init__(self, runner: Runner, stop_ids: frozenset[int], prefill: int, decode_share: float,
                 out: TextIO = sys.stdout, log: TextIO = sys.stderr, parking: ParkingStore | None = None):
        self.runner = runner
        self.model = runner.model
        self.stop_ids = stop_ids
        self.prefill = prefill
        self.decode_share = decode_share
        self.out = out
        self.log = log
        self.parking = parking  # conversations parked in host memory (None: off)
        self.n_slots = len(runner.sessions) - 1
        self.commands: queue.Queue[str | None] = queue.Queue()
        self.pending: deque[Job] = deque()
        self.reading: list[Job] = []  # prompts being read, in command order (several admissions outside exact mode)
        self.order: deque[Job] = deque()  # admissions whose control lines are not all written, in command order
        self.decoding: dict[int, Job] = {}  # session index -> job
        # a decode window queued on the last one's tokens (`Runner.queue`), not read yet, and its rows' jobs
        self.ahead: tuple[Queued, list[Job]] | None = None
        self.quit = False  # QUIT or end of stdin seen: exit once idle
        self.hold_until: float | None = None  # admissions are held (HOLD) until GO or this time (`holding`)
        self.stats = _StatsCounter()
        self.window_log = WindowLog()
        self.last_stats = 0.0

    # -- I/O ----------------------------------------------------------------------------------

    def emit(self, reply: P.Reply) -> None:
        self.out.write(P.format_reply(reply) + "\n")
        self.out.flush()

    def say(self, job: Job, reply: P.Reply) -> None:
        """A control line of `job` (RESUME, PP, its first T, DONE, BADM, YIELDED): an admission's waits until the
        admissions sent before it have said all of theirs, so each request's control lines stay together."""
        if job.slot is None or not self.order or self.order[0] is job:
            self.emit(reply)
        else:
            job.held.append(reply)

    def close(self, job: Job) -> None:
        """`job`'s control lines are all said (BADM): the next admission's held lines are written."""
        job.closed = True
        while self.order and self.order[0].closed:
            for reply in self.order.popleft().then:
                self.emit(reply)
            if self.order:
                for reply in self.order[0].held:
                    self.emit(reply)
                self.order[0].held = []

    def refuse(self, message: str) -> None:
        """ERR for the last command: after the control lines of the admissions sent before it."""
        ahead = [job for job in (*self.order, *self.pending) if job.slot is not None]
        if ahead:
            ahead[-1].then.append(P.Err(message))
        else:
            self.emit(P.Err(message))

    def start_reader(self, stream: TextIO) -> None:
        def pump() -> None:
            for line in stream:
                self.commands.put(line)
            self.commands.put(None)

        threading.Thread(target=pump, name="stdin-reader", daemon=True).start()

    def busy(self) -> bool:
        return bool(self.reading or self.pending or self.decoding)

    def holding(self) -> bool:
        """Whether admissions are held: from HOLD to GO, at most `HOLD_LIMIT_S`, never once QUIT is seen."""
        if self.hold_until is not None and (self.quit or time.perf_counter() >= self.hold_until):
            self.hold_until = None
        return self.hold_until is not None

    def poll(self) -> None:
        """Handle queued commands; block for one only when there is nothing to do (held admissions: until the
        hold's limit at most)."""
        held = self.holding() and not (self.reading or self.decoding)
        block = (held or not self.busy()) and not self.quit
        timeout = max(0.0, self.hold_until - time.perf_counter()) if held and self.hold_until is not None else None
        while True:
            try:
                line = self.commands.get(block=block, timeout=timeout)
            except queue.Empty:
                return
            if line is None:  # end of stdin: finish what was asked, then exit
                self.quit = True
                return
            if line.strip():
                self.handle(line)
            block = False

    # -- commands -----------------------------------------------------------------------------

    def handle(self, line: str) -> None:
        try:
            cmd = P.parse_command(line)
        except P.ProtocolError as exc:
            self.refuse(str(exc))
            return
        match cmd:
            case P.Gen() | P.BGen():
                self.submit(cmd)
            case P.Stop():
                target = ((self.reading[0] if self.reading else None) or self.decoding.get(self.runner.solo.index)
                          or (self.pending[0] if self.pending else None))
                if target is not None:
                    target.stop = True
            case P.BStop(slot):
                for job in self._jobs():
                    if job.slot == slot:
                        job.stop = True
            case P.BYield(slot):
                # the admission into `slot`, reading or not read yet (held: it gives way before its first chunk)
                job = next((j for j in (*self.reading, *self.pending) if j.slot == slot), None) or (
                    self.reading[0] if self.reading and self.reading[0].slot is None else None)
                if job is not None and self._slot_ok(slot, allow=job.slot):
                    job.yield_to = slot
            case P.Quit():
                self.quit = True  # work already queued is finished first
            case P.Hold():
                self.hold_until = time.perf_counter() + HOLD_LIMIT_S
            case P.Go():
                self.hold_until = None

    def _jobs(self) -> list[Job]:
        return [*self.reading, *self.pending, *self.decoding.values()]

    def _slot_ok(self, slot: int, allow: int | None = None) -> bool:
        if not 0 <= slot < self.n_slots:
            return False
        return slot == allow or all(job.slot != slot for job in self._jobs())

    def submit(self, cmd: P.Gen | P.BGen) -> None:
        ctx = self.model.context
        if len(cmd.ids) + cmd.max_new + P.CONTEXT_SLACK > ctx:
            self.refuse(f"prompt ({len(cmd.ids)}) + max_new ({cmd.max_new}) + {P.CONTEXT_SLACK} exceeds the context ({ctx})")
            return
        if max(cmd.ids) >= self.model.hyper.vocab:
            self.refuse(f"token id {max(cmd.ids)} is outside the vocabulary ({self.model.hyper.vocab})")
            return
        slot = cmd.slot if isinstance(cmd, P.BGen) else None
        if slot is not None:
            if self.n_slots == 0:
                self.refuse("no batch slots: start the engine with --batch N")
                return
            if not 0 <= slot < self.n_slots:
                self.refuse(f"slot {slot} does not exist (0..{self.n_slots - 1})")
                return
            if not self._slot_ok(slot):
                self.refuse(f"slot {slot} is busy")
                return
        session = self.runner.solo if slot is None else self.runner.slot(slot)
        seed = cmd.sampling.seed or random.randrange(1, 2**63)
        self.pending.append(Job(slot, session, list(cmd.ids), cmd.max_new, cmd.sampling, seed))

    # -- reads --------------------------------------------------------------------------------

    def start_reads(self) -> None:
        """Start the pending reads that can start now: one when none runs (a GEN waits for the solo session's
        request); outside exact mode also every admission behind reading admissions, to be read with them. While
        admissions are held, the admissions that would start are made ready instead (`prepare`)."""
        held = self.holding()
        for job in list(self.pending):
            if self.reading and (self.runner.exact or job.slot is None or self.reading[0].slot is None):
                return
            if job.session.index in self.decoding:
                return  # a GEN waits until the solo session's request is done
            if held:
                if job.slot is None:
                    return
                self.prepare(job)
                continue
            self.pending.popleft()
            self.start_read(job)

    def admit(self) -> bool:
        """`start_reads`, then again with the commands that came while those reads started, until none
        does: a server sends the BGENs of a burst one line at a time, and the first may wake the loop
        alone; the others come during its reuse (host work: parks, copies) and join its forward instead
        of waiting for the next one. Returns whether any read started."""
        reading = len(self.reading)
        while True:
            started = len(self.reading)
            self.start_reads()
            if len(self.reading) == started or self.commands.empty():
                return len(self.reading) > reading
            self.poll()

    def admit_arrivals(self) -> bool:
        """Start the reads whose commands came during the last forward, before the decoding rows get their share of
        it; returns whether any started. Their first tokens come a share sooner; the decoding rows wait once for
        each such arrival, and arrivals are bounded by the free slots."""
        self.poll()
        return self.admit()

    def start_read(self, job: Job) -> None:
        self.reading.append(job)
        self.prepare(job)
        job.started = time.perf_counter()

    def prepare(self, job: Job) -> None:
        """Make `job`'s session ready for its read, once: park the conversation it holds unless the prompt continues
        it, and give it the longest reusable prefix of any session not busy, or parked (`Runner.reuse`)."""
        if job.prepared:
            return
        busy = set(self.decoding) | {j.session.index for j in (*self.reading, *self.pending) if j.prepared}
        job.prepared = True
        if job.slot is not None:
            self.order.append(job)
        job.reused = self.runner.reuse(job.session, job.prompt, busy, self.parking)
        job.read_start = job.reused
        if job.reused:
            self.say(job, P.Resume(job.reused))

    def read_chunk(self) -> float:
        """One forward over the reads' next tokens (or the end of those stopped or giving way at this
        boundary). Returns the seconds it took."""
        for job in list(self.reading):
            if job.stop:
                self.end_read(job, "cancel")
            elif job.yield_to is not None:
                self.give_way(job)
        parts = self._parts()
        if not parts:
            return 0.0
        t0 = time.perf_counter()
        logits = self.runner.read_parts([(job.session, chunk) for job, chunk in parts])
        dt = time.perf_counter() - t0
        read = sum(len(chunk) for _, chunk in parts)
        self.stats.prefill(read, dt)
        done = []
        for i, (job, chunk) in enumerate(parts):
            job.prompt_read += len(chunk)
            self.say(job, P.Progress(job.read_pos, len(job.prompt), dt * 1000, read / max(dt, 1e-9)))
            if job.read_pos == len(job.prompt):
                job.prompt_ms = (time.perf_counter() - job.started) * 1000
                done.append(i)
        if done:  # every finished read's first token in one pass and one read back, not one each (the same tokens)
            jobs = [parts[i][0] for i in done]
            tokens = self.runner.sample(logits[done], [Draw.after(j.sampling, j.seed, j.session.tokens) for j in jobs])
            for job, token in zip(jobs, tokens, strict=True):
                self.first_token(job, token)
        return dt

    def _parts(self) -> list[tuple[Job, list[int]]]:
        """The next forward's tokens, at most `prefill` in all, the reads in command order: an admission reads
        only once those ahead of it have nothing left, so it never gets its first token before them. A read
        alone takes the chunks it always took (`prefill` tokens from where it started)."""
        parts, left = [], self.prefill
        for job in self.reading:
            chunk = job.prompt[job.read_pos : job.read_pos + left]
            parts.append((job, chunk))
            left -= len(chunk)
            if not left:
                break
        return parts

    def first_token(self, job: Job, token: int) -> None:
        """A read's first token (`sample_rows`' pick for its last row's logits) said, then its decoding goes on."""
        self.reading.remove(job)
        job.decode_started = time.perf_counter()
        job.generated = 1
        self.say(job, P.Token(token, logprob_of(token)))
        finish = self.finish_reason(job, token)
        if job.slot is None:
            if finish:
                self.done(job, finish)
            else:
                job.next_token = token
                self.decoding[job.session.index] = job
            return
        continues = finish is None
        self.done(job, finish or "length")
        self.say(job, P.BAdm(job.slot, continues))
        self.close(job)
        if continues:
            job.next_token = token
            job.decode_started = time.perf_counter()
            self.decoding[job.session.index] = job

    def end_read(self, job: Job, finish: str) -> None:
        self.reading.remove(job)
        job.prompt_ms = (time.perf_counter() - job.started) * 1000
        self.done(job, finish)
        if job.slot is not None:
            self.say(job, P.BAdm(job.slot, False))
            self.close(job)

    def give_way(self, job: Job) -> None:
        """BYIELD at a chunk boundary: the part read waits in the yield slot; the server re-sends."""
        slot = self.runner.slot(job.yield_to)
        if slot is not job.session:
            self.runner.copy(job.session, slot, self.parking)
        self.say(job, P.Yielded(slot.index, len(slot.tokens)))
        self.end_read(job, "cancel")

    # -- decoding -----------------------------------------------------------------------------

    def finish_reason(self, job: Job, token: int) -> str | None:
        if token in self.stop_ids:
            return "stop"
        if job.generated >= job.max_new or job.read_pos + 1 >= self.model.context:
            return "length"
        return None

    def decode_step(self) -> None:
        for index, job in list(self.decoding.items()):
            if job.stop:
                del self.decoding[index]
                self.finish_decoding(job, "cancel")
        queued, self.ahead = self.ahead, None
        if queued is not None and not any(map(self._decodes, queued[1])):
            queued = None  # every row it continued stopped since: its tokens are not wanted
        if not self.decoding and queued is None:
            return
        t0 = time.perf_counter()
        if queued is None:
            jobs = sorted(self.decoding.values(), key=lambda j: j.session.index)
            rows = [Row(job.session, job.next_token, job.sampling, job.seed) for job in jobs]
            if self.runner.can_queue_ahead(rows):
                queued = (self.runner.queue(rows), jobs)
        if queued is None:
            tokens, window = self.runner.decode_window(rows)
        else:
            self._queue_ahead(*queued)
            tokens = queued[0].tokens()
            window, jobs = self.runner.finish(queued[0]), queued[1]
        fed_ahead = {id(job) for job in self.ahead[1]} if self.ahead is not None else set()
        picked = [(job, token) for job, token in zip(jobs, tokens, strict=True)
                  if self._decodes(job)]  # not those stopped since it was queued
        jobs = [job for job, _ in picked]
        served = window.share(len(jobs))
        for job, token in picked:
            job.experts += served
            job.generated += 1
            if job.slot is None:
                self.emit(P.Token(token, logprob_of(token)))
            else:
                job.slot_tokens += 1
                self.emit(P.BToken(job.slot, token, logprob_of(token)))
            job.next_token = token
            finish = self.finish_reason(job, token)
            if finish:
                del self.decoding[job.session.index]
                self.finish_decoding(job, finish)
            elif id(job) in fed_ahead:
                job.session.tokens.append(token)  # the window queued ahead fed it
        seconds = time.perf_counter() - t0
        self.stats.step(len(jobs), seconds, jobs, window)
        tier = self.model.tier
        line = self.window_log.window(len(jobs), seconds, window,
                                      (tier.rounds, tier.swaps, tier.adapt_wait_s) if tier is not None else None)
        if line:
            log(line)

    def _decodes(self, job: Job) -> bool:
        """Whether `job` still decodes (a window queued before it stopped may still hold its row)."""
        return self.decoding.get(job.session.index) is job

    def _queue_ahead(self, window: Queued, jobs: list[Job]) -> None:
        """Queue the next window on `window`'s tokens before reading them, so the device runs it while
        the host handles these: when every decoding row is in `window` and none stops by length at its
        token. A row that stops at its token anyway (a stop token) was fed one token more; its output is
        dropped and its session keeps what it keeps without look-ahead (`Runner.can_queue_ahead`)."""
        live = [job for job in jobs if self._decodes(job)]
        if len(live) != len(self.decoding) or any(
                job.generated + 1 >= job.max_new or job.read_pos + 2 >= self.model.context for job in live):
            return
        rows = [Row(job.session, AHEAD, job.sampling, job.seed) for job in live]
        if self.runner.can_queue_ahead(rows):
            self.ahead = (self.runner.queue(rows, after=window), live)
            if self.runner.queued_ahead == 1:
                log("decode windows queued ahead: each on the device tokens of the last, before the host reads them")

    def decode_steps_for(self, seconds: float) -> None:
        deadline = time.perf_counter() + seconds
        while self.decoding:
            self.decode_step()
            self.poll()
            if time.perf_counter() >= deadline:
                return

    def finish_decoding(self, job: Job, finish: str) -> None:
        if job.slot is None:
            self.done(job, finish)
        else:
            ms = (time.perf_counter() - job.decode_started) * 1000
            self.emit(P.BDone(job.slot, job.slot_tokens, finish, ms))

    def done(self, job: Job, finish: str) -> None:
        decode_ms = (time.perf_counter() - job.decode_started) * 1000 if job.decode_started else 0.0
        self.say(job, P.Done(job.generated, len(job.prompt), job.prompt_ms, decode_ms, finish,
                         reused=job.reused, hits=job.experts.vram, lookups=job.experts.lookups - job.experts.pcie,
                         prompt_read=job.prompt_read, offloaded=job.experts.pcie))  # upstream: lookups exclude PCIe

    # -- main loop ----------------------------------------------------------------------------

    def run(self) -> None:
        while not (self.quit and not self.busy() and self.commands.empty()):
            if self.parking is not None and not self.busy() and self.commands.empty() \
                    and self.runner.park_ahead(self.parking):
                continue  # one conversation's park copied ahead while idle; commands are looked at before the next
            self.poll()
            self.admit()
            if self.reading:
                spent = self.read_chunk()
                if self.decoding and spent and not self.admit_arrivals():
                    self.decode_steps_for(spent * self.decode_share)
            elif self.decoding:
                self.decode_step()
            self.maybe_stats()

    def maybe_stats(self) -> None:
        now = time.perf_counter()
        idle = not self.busy()
        if self.stats.dirty and (idle or now - self.last_stats >= STATS_INTERVAL_S):
            snap = self.stats.snapshot(self.model, self.n_slots)
            if self.parking is not None:
                snap["parking"] = self.parking.stats()
            self.emit(P.Stats(snap))
            self.last_stats = now


class _StatsCounter:
    """Totals and per-interval means for the STATS line."""

    def __init__(self) -> None:
        self.windows = self.tokens = self.prefill_tokens = 0
        self.prefill_s = 0.0
        self.slot_tokens: dict[str, int] = {}
        self.interval_windows = self.interval_rows = 0
        self.interval_s = 0.0
        self.experts = ExpertStats()  # routed entries of decode windows (total)
        self.dirty = False

    def prefill(self, n: int, seconds: float) -> None:
        self.prefill_tokens += n
        self.prefill_s += seconds
        self.dirty = True

    def step(self, rows: int, seconds: float, jobs: list[Job], experts: ExpertStats) -> None:
        self.windows += 1
        self.experts += experts
        self.tokens += rows
        self.interval_windows += 1
        self.interval_rows += rows
        self.interval_s += seconds
        for job in jobs:
            if job.slot is not None:
                key = str(job.slot)
                self.slot_tokens[key] = self.slot_tokens.get(key, 0) + 1
        self.dirty = True

    def snapshot(self, model: Model, n_slots: int) -> dict:
        n = max(self.interval_windows, 1)
        snap = {
            "windows": self.windows,
            "rows": round(self.interval_rows / n, 2),
            "window_ms": round(self.interval_s * 1000 / n, 2),
            "tokens": self.tokens,
            "slot_tokens": dict(self.slot_tokens),
            "prefill_tokens": self.prefill_tokens,
            "prefill_ms": round(self.prefill_s * 1000, 1),
            "tier": _tier(model, self.experts),
            "memory": memory_split(model, n_slots),
        }
        self.interval_windows = self.interval_rows = 0
        self.interval_s = 0.0
        self.dirty = False
        return snap


def _tier(model: Model, served: ExpertStats) -> dict | None:
    """The tier fields of STATS: the decode windows' counted entries, and the tier's own figures
    (swaps, rounds, wait, cache size) when one is installed, else every expert is resident."""
    if not model.hyper.experts:
        return None
    n = max(served.lookups, 1)
    tier = {"mode": "resident", "swaps": 0, "adapt_rounds": 0, "adapt_wait_ms": 0.0}
    if model.tier is not None:
        tier = model.tier.figures()
    return {**tier, "vram": served.vram / n, "pcie": served.pcie / n, "cpu": served.cpu / n, "hits": served.vram,
            "lookups": served.lookups, "offloaded": served.pcie, "cpu_ms": round(served.cpu_us / 1000, 3)}
