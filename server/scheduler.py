"""Which request runs where: the solo path, the batch slots, the FIFO of waiting requests.

Rules (the seed's "batch slots" page):

- Without batch slots (or with INFO batch_slots < 2) one request runs at a time (`GEN`), the others
  wait in a bounded FIFO.
- With N >= 2 slots a request alone runs on the solo path (`GEN`). When another arrives, the solo
  request gets `STOP` (at its next token) and, if not finished, continues in a slot (`BGEN` with
  prompt + generated; the engine's prompt cache makes that free); the newcomer is admitted next.
  Outside exact mode, a request chosen for the solo path whose GEN has not gone out when others have
  come (a burst reaches the scheduler one request at a time) is admitted into a slot instead, first,
  and the others behind it, so they are read together (`_join_burst`).
- A request left alone in a slot goes back to the solo path (`BSTOP`, then `GEN` with everything), at
  most twice per request; STRATA_PARALLEL_SOLO=0 turns that off.
- With slots, while other requests are still on their way (parsed and tokenized by their routes: `arriving`),
  the waiting ones are held, at most `HOLD_FOR_ARRIVALS_S`: a burst's requests reach `submit` ~1-2 ms
  apart, and the engine reads together only the admissions it has when a read starts, so the first
  sent alone would be read alone and the others after it (a second forward before their first tokens).
  Outside exact mode the engine holds them (`HOLD`, then each one's `BGEN` as it comes, into a slot, then
  `GO` behind the last): it parks what their slots held while the rest arrive. In exact mode they wait
  here. Without slots every request runs alone anyway: nothing is held.
- More requests than slots wait, FIFO. The control lines (everything of a GEN, an admission's up to its
  BADM) are read by one request at a time, in the order the GEN/BGENs were sent (`control`). Outside
  exact mode admissions are sent while others read (pipelined): the engine reads them together and
  writes each admission's control lines after those of the admissions before it.
- A prompt under half as long as the one being read (no token yet), waiting or sent behind it, makes the
  read give way (`BYIELD`, at most twice per request): the engine reads admissions in the order sent, so
  a short one behind a long one would wait for all of it. The yielded request is sent again later with
  `BGEN` into the slot holding its part read, after everyone waiting at that moment.
- Slot choice: the free slot whose held tokens are the longest prefix of the prompt, else an empty
  one, else the least recently used; empty slots are taken across pipeline groups in turn.
  The engine parks the conversation of a slot it gives to another one in host memory and finds
  parked conversations itself (docs/protocol.md, Conversation parking), so parking needs nothing here.
- A request whose client is gone gets `STOP` (solo) or `BSTOP` (admission, slot); its lines are
  still read to the end, so nothing of it reaches the next request.

Every decision is taken in `_schedule()`, a plain method called after each state change; the engine
lines of a GEN/BGEN are read by that request's task from the control queue, those of a slot from the
slot's queue. Each GEN/BGEN sent is a `Segment` of its job; when its DONE (or BDONE) is read,
`Segment.end` says what follows (`SegmentEnd`: finished, preempted, yielded, back to solo). What the
request's HTTP route hears comes as `server.events.JobEvent`s on `Job.out`; a failure's HTTP status
is its error's class (`server.errors`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import itertools
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from engine.protocol import (
    BAdm,
    BDone,
    BGen,
    BStop,
    BToken,
    BYield,
    Done,
    Err,
    Gen,
    Go,
    Hold,
    Logprob,
    Progress,
    Resume,
    Sampling,
    Stop,
    Token,
    Yielded,
    format_command,
)
from server.engine_client import EngineDied, EngineLaunch, EngineProcess, EngineSupervisor, say
from server.errors import EngineRefused, EngineUnavailable, InternalError, QueueFull, RequestFailed
from server.events import DoneEvent, ErrorEvent, JobEvent, ProgressEvent, TokenEvent

MAX_YIELDS = 2
MAX_RETURNS_TO_SOLO = 2
HOLD_FOR_ARRIVALS_S = 0.025  # a burst's parses and tokenizations take ~0.5-2 ms a request


class SegmentEnd(enum.Enum):
    """How a GEN/BGEN ended, decided when its DONE (or BDONE) is read."""

    FINISHED = "finished"  # the reply is over (or its client left): the job ends
    PREEMPTED = "preempted"  # a solo GEN stopped for a newcomer: the job goes on in a slot, first in line
    YIELDED = "yielded"  # a read gave way (BYIELD): last in line, later into the slot holding its part read
    BACK_TO_SOLO = "back_to_solo"  # alone in its slot, stopped (BSTOP): goes on as GEN, first in line


@dataclass(eq=False)
class Segment:
    """One GEN (`slot` None) or BGEN the scheduler sent for a job, from sending it to its DONE or BDONE."""

    slot: int | None
    prompt_tokens: int  # prompt + what the job generated before this segment
    started: float = field(default_factory=time.monotonic)
    tokens: int = 0  # produced in this segment
    admitted: bool = False  # BADM 1 read: a BGEN goes on in its slot, its lines on the slot's queue
    stop_sent: bool = False  # STOP sent (solo or admission)
    yield_sent: bool = False  # BYIELD sent
    asked: SegmentEnd | None = None  # why the scheduler ended it early (preempted, yielded, back to solo)

    @property
    def mode(self) -> str:
        """solo (GEN), admit (a BGEN before its BADM: the control lines) or slot (after BADM 1)."""
        return "solo" if self.slot is None else "slot" if self.admitted else "admit"

    def end(self, job: Job, finish: str) -> SegmentEnd:
        """What the scheduler asked for, when the engine cancelled the segment for it and the job was not
        cancelled by its client; else the job is over."""
        if self.asked is None or job.cancelled or finish != "cancel":
            return SegmentEnd.FINISHED
        if self.asked is SegmentEnd.YIELDED or job.remaining > 0:
            return self.asked
        return SegmentEnd.FINISHED


class Opened(NamedTuple):
    """A segment whose GEN or BGEN was sent (`Scheduler._open`): its slot, and the engine's death if the line could
    not go."""

    segment: Segment
    slot: Slot | None
    died: EngineDied | None = None


_ids = itertools.count(1)


@dataclass(eq=False)
class Job:
    prompt: list[int]
    max_new: int
    sampling: Sampling = field(default_factory=Sampling)
    endpoint: str = "chat"
    id: str = field(default_factory=lambda: f"{next(_ids)}")
    out: asyncio.Queue[JobEvent] = field(default_factory=asyncio.Queue)
    generated: list[int] = field(default_factory=list)
    created: float = field(default_factory=time.monotonic)
    wall: float = field(default_factory=time.time)
    cancelled: str | None = None  # "disconnect" | "stop" (a stop string matched)
    finish: str | None = None
    error: str | None = None
    # where it runs
    state: str = "waiting"  # waiting | reading | decoding | done
    segment: Segment | None = None  # the GEN/BGEN running now (None while waiting or done)
    slot: int | None = None
    reserved_slot: int | None = None
    yields: int = 0
    returns_to_solo: int = 0
    paths: list[str] = field(default_factory=list)
    # figures
    segments: int = 0
    reused: int = 0
    prompt_read: int = 0
    prompt_total: int = 0
    prompt_ms: float = 0.0
    decode_ms: float = 0.0
    hits: int = 0
    lookups: int = 0
    first_token_at: float | None = None
    finished_at: float | None = None
    last_chunk_s: float = 0.0
    prefill_tok_s: float = 0.0

    @property
    def context(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def remaining(self) -> int:
        return self.max_new - len(self.generated)

    @property
    def mode(self) -> str | None:
        """Its segment's mode (solo, admit, slot), None while it waits or after it ended."""
        return self.segment.mode if self.segment is not None else None


@dataclass(eq=False)
class Slot:
    index: int
    job: Job | None = None
    held: list[int] = field(default_factory=list)
    reserved_for: Job | None = None
    last_used: float = 0.0
    started: float = 0.0
    generated: int = 0
    stopping: bool = False

    @property
    def free(self) -> bool:
        return self.job is None and self.reserved_for is None


class Scheduler:
    """Decides which request runs where; the watcher of its `EngineSupervisor` (`self.sup`), which it
    builds from `launch`. `on_finish(job)` and `on_tokens(n)` feed the figures, `on_stats` gets STATS."""

    def __init__(self, launch: EngineLaunch, queue_limit: int, on_finish: Callable[[Job], None] | None = None,
                 on_tokens: Callable[[int], None] | None = None,
                 on_stats: Callable[[dict], None] | None = None):
        self.sup = EngineSupervisor(launch, self, on_stats)
        self.queue_limit = queue_limit
        self.on_finish = on_finish
        self.on_tokens = on_tokens
        self.waiting: collections.deque[Job] = collections.deque()
        # jobs whose GEN/BGEN was sent and whose control lines are not all read, in the order sent: the first reads
        self.control: collections.deque[Job] = collections.deque()
        self._head_changed = asyncio.Event()
        self.pipelined = False  # admissions sent while others read (`_pipelines`): from the engine's INFO
        self.slots: list[Slot] = []
        self.groups = 1
        self.last_group = -1
        self.running: set[Job] = set()
        self.solo_enabled = os.environ.get("STRATA_PARALLEL_SOLO", "1") != "0"
        self._starting: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._arriving = 0  # requests between their route's start and `submit` (`arriving`)
        self._hold: asyncio.TimerHandle | None = None  # ends a hold for arrivals (`_held_for_arrivals`)
        self._hold_ran_out = False
        self._engine_held = False  # HOLD sent, its GO not yet

    # -- public -------------------------------------------------------------------------------
    @property
    def nslots(self) -> int:
        return len(self.slots)

    @property
    def control_job(self) -> Job | None:
        """The job reading the control lines now."""
        return self.control[0] if self.control else None

    @contextlib.contextmanager
    def arriving(self) -> Iterator[None]:
        """Around a request's parse and tokenization, before its `submit`: what waits meanwhile is held back
        (`_held_for_arrivals`) so that a burst's requests go to the engine together."""
        self._arriving += 1
        try:
            yield
        finally:
            self._arriving -= 1
            if not self._arriving:
                if self._hold is not None:
                    self._hold.cancel()
                self._hold, self._hold_ran_out = None, False
                if self.waiting:
                    self._schedule()  # what was held (or waits behind an arrival that failed) goes on now
                elif self._engine_held:  # after this request's submit (no await between): its BGEN before GO
                    asyncio.get_running_loop().call_soon(self._schedule)

    def submit(self, job: Job) -> None:
        if len(self.waiting) >= self.queue_limit:
            raise QueueFull(f"the server is busy: {len(self.waiting)} requests are waiting "
                            f"(queue_limit {self.queue_limit}); try again later")
        self.waiting.append(job)
        self._schedule()

    def cancel(self, job: Job, reason: str) -> None:
        """The client is gone (or a stop string matched): end the job's engine work, keep reading its lines."""
        if job.state == "done" or job.cancelled:
            return
        job.cancelled = reason
        if job in self.waiting:
            self.waiting.remove(job)
            if job.reserved_slot is not None:
                self._unreserve(job)
            self._finish(job, reason)
            self._schedule()
            return
        engine = self.sup.engine
        seg = job.segment
        if engine is None or not engine.alive or seg is None:
            return
        try:
            if seg.mode == "solo" and not seg.stop_sent:
                seg.stop_sent = True
                engine.send(format_command(Stop()))
            elif seg.mode in ("admit", "slot") and not self.slots[seg.slot].stopping:
                seg.stop_sent = True
                self._stop_slot(engine, seg.slot)
        except EngineDied:
            pass

    # -- the supervisor's watcher ---------------------------------------------------------------
    def engine_ready(self, engine: EngineProcess) -> None:
        n = engine.info.get("batch_slots", 0)
        n = n if isinstance(n, int) and n >= 2 else 0
        self.slots = [Slot(i) for i in range(n)]
        g = engine.info.get("batch_groups", 1)
        self.groups = g if isinstance(g, int) and g >= 1 and n and n % g == 0 else 1
        self.pipelined = not engine.info.get("exact")  # the engine reads admissions sent together together
        self._engine_held = False
        self._drop_control()

    def engine_died(self, engine: EngineProcess) -> None:
        # the jobs reading queues learn it from the EngineDied put in every queue; forget the slots
        self._drop_control()
        self._engine_held = False
        for s in self.slots:
            s.job, s.reserved_for, s.held, s.stopping = None, None, [], False
        for job in list(self.waiting):
            job.reserved_slot = None
        if self.waiting:
            asyncio.get_running_loop().call_soon(self._schedule)

    def busy(self) -> bool:
        return bool(self.running)

    def reading(self) -> tuple[bool, float]:
        job = self.control_job
        if job is None or (job.segment is not None and job.segment.tokens):
            return False, 0.0
        return True, job.last_chunk_s

    async def _start_engine(self) -> None:
        try:
            await self.sup.ensure_ready()
        except EngineDied as exc:
            for job in list(self.waiting):
                self.waiting.remove(job)
                self._fail(job, EngineUnavailable(f"the engine could not be started: {exc}"))
        finally:
            self._starting = None
        self._schedule()

    # -- the decisions ------------------------------------------------------------------------
    def _schedule(self) -> None:
        engine = self.sup.engine
        if engine is None or not engine.alive:
            if self.waiting and self._starting is None:
                self._starting = asyncio.get_running_loop().create_task(self._start_engine())
            return
        self._decide(engine)
        if self._engine_held and not self._held_for_arrivals():  # nothing arriving any more, or the hold ran out
            self._engine_held = False
            self._send(engine, format_command(Go()))  # behind the held BGENs: they went out as they were sent

    def _decide(self, engine: EngineProcess) -> None:
        """`_schedule`'s decisions: a preemption or a yield, a return to solo, the waiting requests sent (held while
        others arrive)."""
        cj = self.control_job
        if cj is not None:
            if self.slots and (self.waiting or len(self.control) > 1) and cj.segment is not None:
                self._maybe_preempt(engine, cj, cj.segment)
            if not self._pipelines():
                return
        if cj is None and not self.waiting:
            self._maybe_return_to_solo(engine)
            return
        held = bool(self.waiting) and bool(self.slots) and self._held_for_arrivals()
        if held and not self.pipelined:
            return
        if held and not self._engine_held:
            self._engine_held = True
            self._send(engine, format_command(Hold()))
        self._send_waiting(engine, held)

    def _send_waiting(self, engine: EngineProcess, held: bool) -> None:
        """Send the waiting requests that can go now, in turn: alone and idle on the solo path (not while
        `held`), else into a slot. An admission's BGEN goes out now (`_open`), so a burst's reach the engine as
        their routes submit them (their routes run one after another in a turn of the event loop); a GEN when its
        task first runs, so that a burst arriving meanwhile can still take it into a slot (`_join_burst`)."""
        while self.waiting:
            job = self.waiting[0]
            busy = any(s.job is not None for s in self.slots)
            if not self.control and not held and (not self.slots or (not busy and len(self.waiting) == 1 and
                                                                      self._solo_ok(job))):
                slot = None
            else:
                slot = self.pick_slot(job)
                if slot is None:
                    return
                slot.job, slot.reserved_for = job, None  # taken now, before the task runs
            self.waiting.popleft()
            job.slot = None if slot is None else slot.index
            self.control.append(job)  # its control lines come after those of the jobs sent before it
            self.running.add(job)
            job.state = "reading"
            self._spawn(job, self._run_control(engine, job, None if slot is None else self._open(engine, job, slot)))
            if slot is None or not self._pipelines():
                return

    def _held_for_arrivals(self) -> bool:
        """Whether the waiting requests (or those the engine holds) are held for the ones still arriving: until none
        is, at most `HOLD_FOR_ARRIVALS_S` (then no hold again until a moment with none arriving)."""
        if not self._arriving or self._hold_ran_out:
            return False
        if self._hold is None:
            self._hold = asyncio.get_running_loop().call_later(HOLD_FOR_ARRIVALS_S, self._end_hold)
        return True

    def _end_hold(self) -> None:
        self._hold, self._hold_ran_out = None, True
        self._schedule()

    def _pipelines(self) -> bool:
        """Whether another admission may be sent now: outside exact mode, behind admissions only."""
        return self.pipelined and all(j.slot is not None for j in self.control)

    def _drop_control(self, job: Job | None = None) -> None:
        """`job` (None: every job) no longer reads the control lines; the next one in line does."""
        if job is None:
            self.control.clear()
        elif job in self.control:
            self.control.remove(job)
        changed, self._head_changed = self._head_changed, asyncio.Event()
        changed.set()

    async def _turn(self, engine: EngineProcess, job: Job) -> None:
        """Until `job` reads the control lines (or the engine is gone)."""
        while engine.alive and self.control and self.control[0] is not job:
            await self._head_changed.wait()

    def _stop_slot(self, engine: EngineProcess, slot: int) -> None:
        """BSTOP: ends an admission into `slot` (reading, or waiting behind others) or the slot's decoding."""
        self.slots[slot].stopping = True
        self._send(engine, format_command(BStop(slot)))

    def _solo_ok(self, job: Job) -> bool:
        return job.reserved_slot is None and (job.remaining > 1 or not job.generated)

    def _join_burst(self, job: Job) -> Slot | None:
        """A slot for a request chosen for the solo path whose GEN has not gone out yet, when others came
        meanwhile (the requests of a burst reach the scheduler one by one, each before this task runs):
        it is admitted first and they are read with it, instead of after its read alone and a STOP.
        Only where admissions are read together (outside exact mode)."""
        if not (self.pipelined and self.waiting and self.control_job is job):
            return None
        return self.pick_slot(job)  # `_begin` takes it

    def _maybe_preempt(self, engine: EngineProcess, cj: Job, seg: Segment) -> None:
        if seg.stop_sent or cj.cancelled:
            return
        if seg.tokens == 0:  # still reading its prompt: give way to a much shorter one?
            if seg.yield_sent or cj.yields >= MAX_YIELDS:
                return
            shortest = min(len(w.context) for w in (*self.waiting, *list(self.control)[1:]))
            if shortest * 2 >= seg.prompt_tokens:
                return
            if seg.mode == "admit":
                slot = seg.slot
            else:
                free = self._free_slots()
                if not free:
                    return
                pick = next((s for s in free if not s.held), None) or min(free, key=lambda s: s.last_used)
                pick.reserved_for, cj.reserved_slot = cj, pick.index
                slot = pick.index
            seg.yield_sent = True
            self._send(engine, format_command(BYield(slot)))
        elif seg.mode == "solo":  # someone arrived: the solo request goes on in a slot
            seg.stop_sent, seg.asked = True, SegmentEnd.PREEMPTED
            self._send(engine, format_command(Stop()))

    def _maybe_return_to_solo(self, engine: EngineProcess) -> None:
        if not self.solo_enabled:
            return
        active = [s for s in self.slots if s.job is not None]
        if len(active) != 1:
            return
        s = active[0]
        job = s.job
        assert job is not None
        seg = job.segment
        if s.stopping or seg is None or seg.mode != "slot" or seg.asked is not None or job.cancelled:
            return
        if job.returns_to_solo >= MAX_RETURNS_TO_SOLO or job.remaining <= 1:
            return
        seg.asked = SegmentEnd.BACK_TO_SOLO
        self._stop_slot(engine, s.index)

    def _free_slots(self) -> list[Slot]:
        return [s for s in self.slots if s.free]

    def slot_order(self) -> list[int]:
        """Slots interleaved across pipeline groups: 0, gs, 2gs, ..., 1, gs+1, ..."""
        n, g = len(self.slots), self.groups
        gs = max(1, n // g)
        return [grp * gs + i for i in range(gs) for grp in range(g) if grp * gs + i < n]

    def pick_slot(self, job: Job) -> Slot | None:
        if job.reserved_slot is not None:
            s = self.slots[job.reserved_slot]
            return s if s.job is None else None
        free = self._free_slots()
        if not free:
            return None
        ids = job.context
        best, best_len = None, 0
        for s in free:
            n = len(s.held)
            if 0 < n <= len(ids) and n > best_len and ids[:n] == s.held:
                best, best_len = s, n
        if best is not None:
            return best
        gs = max(1, len(self.slots) // self.groups)
        empty = [self.slots[i] for i in self.slot_order() if not self.slots[i].held and self.slots[i].free]
        if empty:
            other = [s for s in empty if s.index // gs != self.last_group]
            return (other or empty)[0]
        return min(free, key=lambda s: s.last_used)

    # -- running ------------------------------------------------------------------------------
    def _spawn(self, job: Job, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._task_done(job, t))

    def _task_done(self, job: Job, task: asyncio.Task) -> None:
        """A bug must not leave a client hanging: the job fails, the control lines are freed."""
        self._tasks.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        say(f"internal error while running request {job.id}: {exc!r}")
        self._drop_control(job)
        engine = self.sup.engine
        for s in self.slots:
            if s.job is job:
                s.job = None
                if job.mode == "slot" and engine is not None and engine.alive:
                    s.reserved_for = job  # nobody gets the slot before its BDONE is read
                    self._send(engine, format_command(BStop(s.index)))
                    asyncio.get_running_loop().create_task(self._drain_slot(engine, s, job))
        self._fail(job, InternalError(f"internal server error: {exc!r}"))
        self._schedule()

    async def _drain_slot(self, engine: EngineProcess, slot: Slot, job: Job) -> None:
        q = engine.slot_queues[slot.index]
        while True:
            item = await q.get()
            if type(item) is BDone or isinstance(item, EngineDied):
                break
        if slot.reserved_for is job:
            slot.reserved_for = None
        self._schedule()

    def _send(self, engine: EngineProcess, line: str) -> None:
        try:
            engine.send(line)
        except EngineDied:
            pass

    def _begin(self, job: Job, slot: Slot | None) -> tuple[Segment, str]:
        """The job's new segment, and its GEN or BGEN line."""
        ids = job.context
        seg = Segment(None if slot is None else slot.index, len(ids))
        job.segment, job.state = seg, "reading"
        job.segments += 1
        if slot is None:
            job.paths.append("solo")
            return seg, format_command(Gen(job.remaining, tuple(ids), job.sampling))
        job.slot = slot.index
        job.paths.append("slot")
        slot.job, slot.reserved_for = job, None
        job.reserved_slot = None
        slot.started, slot.generated, slot.stopping = time.monotonic(), 0, False
        gs = max(1, len(self.slots) // self.groups)
        self.last_group = slot.index // gs
        return seg, format_command(BGen(slot.index, job.remaining, tuple(ids), job.sampling))

    def _open(self, engine: EngineProcess, job: Job, slot: Slot | None) -> Opened:
        """Begin the job's segment and send its GEN (slot None: into a slot instead where a burst came meanwhile)
        or BGEN."""
        control = engine.control
        while self.control_job is job and not control.empty():  # nothing stale may reach this request
            item = control.get_nowait()
            if isinstance(item, EngineDied):
                control.put_nowait(item)
                break
        joined = slot is None and (slot := self._join_burst(job)) is not None
        seg, line = self._begin(job, slot)
        try:
            engine.send(line)
        except EngineDied as exc:
            return Opened(seg, slot, exc)
        if joined:
            self._schedule()  # the others' admissions go out behind it, to be read with it
        return Opened(seg, slot)

    async def _run_control(self, engine: EngineProcess, job: Job, opened: Opened | None) -> None:
        """One GEN or BGEN: the BGEN `opened` sent, or (None) a GEN sent now (`_open`: into a slot instead where a
        burst came meanwhile); then its control lines read to DONE (and BADM)."""
        seg, slot, died = opened or self._open(engine, job, None)
        control = engine.control
        ids = job.context
        done: Done | None = None
        try:
            if died is not None:
                raise died
            if job.cancelled and not seg.stop_sent:  # gone before its GEN went out: `cancel` had nothing to stop
                seg.stop_sent = True
                if slot is None:
                    engine.send(format_command(Stop()))
                else:
                    self._stop_slot(engine, slot.index)
            await self._turn(engine, job)
            while True:
                item = await control.get()
                t = type(item)
                if t is Token:
                    self._token(job, seg, item.id, item.logprob)
                    if seg.tokens == 1:
                        job.state = "decoding"
                        if self.slots and self.waiting:
                            self._schedule()
                elif t is Progress:
                    job.prompt_read = item.read
                    job.prompt_total = item.total
                    job.last_chunk_s = item.ms / 1000
                    job.prefill_tok_s = item.tok_s
                    job.out.put_nowait(ProgressEvent(item.read, item.total))
                elif t is Resume:
                    if job.segments == 1:
                        job.reused = item.reused
                elif t is Yielded:
                    seg.asked = SegmentEnd.YIELDED
                    job.yields += 1
                    job.reserved_slot = item.slot
                    s = self.slots[item.slot] if 0 <= item.slot < len(self.slots) else None
                    if s is not None:
                        s.held = ids[: item.tokens]
                        s.reserved_for = job
                elif t is Done:
                    done = item
                    self._account(job, item)
                    if slot is None:
                        break
                elif t is BAdm:
                    seg.admitted = item.continues
                    break
                elif t is Err:
                    raise EngineRefused(f"engine error: {item.message}")
                elif isinstance(item, EngineDied):
                    control.put_nowait(item)  # for the jobs in line behind this one
                    raise item
        except EngineDied as exc:
            self._release_control(job, slot)
            self._fail(job, EngineUnavailable(f"the engine stopped during this request: {exc}"))
            return
        except EngineRefused as exc:
            self._release_control(job, slot)
            self._fail(job, exc)
            self._schedule()
            return
        assert done is not None
        # -- after the control lines
        if slot is not None and seg.admitted:
            self._drop_control(job)
            slot.generated = 1
            if job.cancelled and not slot.stopping:
                self._stop_slot(engine, slot.index)
            self._schedule()
            await self._run_slot(engine, job, slot, seg)
            return
        self._release_control(job, slot)
        end = seg.end(job, done.finish)
        if end is SegmentEnd.FINISHED:
            if job.reserved_slot is not None:
                self._unreserve(job)
            if slot is not None:
                slot.held = job.context
            length = done.finish == "cancel" and job.remaining <= 0
            self._finish(job, job.cancelled or ("length" if length else done.finish))
        else:
            self._requeue(job, end)
        self._schedule()

    def _requeue(self, job: Job, end: SegmentEnd) -> None:
        """Back in line after a segment ended early: a yielded read after everyone waiting now, the others first."""
        job.state, job.segment = "waiting", None
        self.running.discard(job)
        if end is SegmentEnd.PREEMPTED:
            self.waiting.appendleft(job)  # it goes on in a slot, first
            return
        job.slot = None
        if end is SegmentEnd.YIELDED:
            self.waiting.append(job)
        else:
            job.returns_to_solo += 1
            self.waiting.appendleft(job)

    def _release_control(self, job: Job, slot: Slot | None) -> None:
        self._drop_control(job)
        if slot is not None and slot.job is job:
            slot.job = None
            slot.last_used = time.monotonic()
        yielded = job.segment is not None and job.segment.asked is SegmentEnd.YIELDED
        if job.reserved_slot is not None and not yielded:
            self._unreserve(job)

    def _unreserve(self, job: Job) -> None:
        if job.reserved_slot is not None and job.reserved_slot < len(self.slots):
            s = self.slots[job.reserved_slot]
            if s.reserved_for is job:
                s.reserved_for = None
        job.reserved_slot = None

    async def _run_slot(self, engine: EngineProcess, job: Job, slot: Slot, seg: Segment) -> None:
        q = engine.slot_queues[slot.index]
        bdone: BDone | None = None
        try:
            while True:
                item = await q.get()
                if type(item) is BToken:
                    slot.generated += 1
                    self._token(job, seg, item.id, item.logprob)
                elif type(item) is BDone:
                    bdone = item
                    break
                elif isinstance(item, EngineDied):
                    raise item
        except EngineDied as exc:
            self._fail(job, EngineUnavailable(f"the engine stopped during this request: {exc}"))
            return
        job.decode_ms += bdone.ms
        slot.job = None
        slot.stopping = False
        slot.held = job.context[:-1]
        slot.last_used = time.monotonic()
        end = seg.end(job, bdone.finish)
        if end is SegmentEnd.FINISHED:
            self._finish(job, job.cancelled or bdone.finish)
        else:
            self._requeue(job, end)
        self._schedule()

    def _token(self, job: Job, seg: Segment, token: int, logprob: Logprob | None) -> None:
        job.generated.append(token)
        seg.tokens += 1
        if job.first_token_at is None:
            job.first_token_at = time.monotonic()
        job.out.put_nowait(TokenEvent(token, logprob))
        if self.on_tokens is not None:
            self.on_tokens(1)

    def _account(self, job: Job, d: Done) -> None:
        job.prompt_ms += d.prompt_ms
        job.decode_ms += d.decode_ms
        job.hits += d.hits
        job.lookups += d.lookups
        if job.segments == 1:
            job.reused = max(job.reused, d.reused)
            job.prompt_total = d.prompt_tokens

    def _end(self, job: Job) -> None:
        job.state, job.segment = "done", None
        job.finished_at = time.monotonic()
        self.running.discard(job)

    def _finish(self, job: Job, finish: str) -> None:
        if job.state == "done":
            return
        self._end(job)
        job.finish = finish
        job.out.put_nowait(DoneEvent(finish))
        if self.on_finish is not None:
            self.on_finish(job)

    def _fail(self, job: Job, error: RequestFailed) -> None:
        if job.state == "done":
            return
        self._end(job)
        job.finish = "error"
        job.error = str(error)
        if job.slot is not None and job.slot < len(self.slots) and self.slots[job.slot].job is job:
            self.slots[job.slot].job = None
        job.out.put_nowait(ErrorEvent(error))
        if self.on_finish is not None:
            self.on_finish(job)
