"""Slot choice (pick_slot), the group interleaving and how a segment ends, on the scheduler alone."""

from __future__ import annotations

import asyncio
from pathlib import Path

from server.engine_client import EngineLaunch
from server.scheduler import HOLD_FOR_ARRIVALS_S, Job, Scheduler, Segment, SegmentEnd, Slot


def scheduler(n: int, groups: int = 1) -> Scheduler:
    sch = Scheduler(EngineLaunch(["true"], {}, Path("/dev/null"), 0), queue_limit=4)
    sch.slots = [Slot(i) for i in range(n)]
    sch.groups = groups
    return sch


def test_longest_held_prefix_wins():
    sch = scheduler(4)
    sch.slots[1].held = [1, 2, 3]
    sch.slots[2].held = [1, 2, 3, 4, 5]
    sch.slots[3].held = [1, 2, 9]
    assert sch.pick_slot(Job([1, 2, 3, 4, 5, 6, 7], 5)).index == 2
    assert sch.pick_slot(Job([1, 2, 3, 8], 5)).index == 1


def test_else_an_empty_slot_else_the_least_recently_used():
    sch = scheduler(3)
    for i, s in enumerate(sch.slots):
        s.held = [100 + i]
        s.last_used = [5.0, 1.0, 3.0][i]
    assert sch.pick_slot(Job([7, 7], 5)).index == 1  # LRU
    sch.slots[2].held = []
    assert sch.pick_slot(Job([7, 7], 5)).index == 2  # empty beats LRU


def test_busy_and_reserved_slots_are_not_picked():
    sch = scheduler(2)
    other = Job([1], 5)
    sch.slots[0].job = other
    sch.slots[1].reserved_for = other
    assert sch.pick_slot(Job([1, 2], 5)) is None
    yielded = Job([1, 2], 5)
    yielded.reserved_slot = 1
    sch.slots[1].reserved_for = yielded
    assert sch.pick_slot(yielded).index == 1  # a yielded request goes back to the slot holding its read


def test_slot_order_interleaves_pipeline_groups():
    sch = scheduler(8, groups=4)
    assert sch.slot_order() == [0, 2, 4, 6, 1, 3, 5, 7]
    sch.last_group = 0
    assert sch.pick_slot(Job([1], 5)).index == 2  # not the group of the last admission
    sch.last_group = 1
    assert sch.pick_slot(Job([1], 5)).index == 0
    assert scheduler(4, groups=1).slot_order() == [0, 1, 2, 3]


def test_a_segment_ends_as_asked_only_when_the_engine_cancelled_it_and_work_is_left():
    job = Job([1, 2], 5)
    solo = Segment(None, 2)
    assert solo.mode == "solo" and solo.end(job, "length") is SegmentEnd.FINISHED  # nothing asked
    solo.asked = SegmentEnd.PREEMPTED
    assert solo.end(job, "cancel") is SegmentEnd.PREEMPTED
    assert solo.end(job, "stop") is SegmentEnd.FINISHED  # it ended by itself before the STOP
    job.generated = [3] * 5
    assert solo.end(job, "cancel") is SegmentEnd.FINISHED  # stopped on its last token: nothing left
    admit = Segment(1, 2, asked=SegmentEnd.YIELDED)
    assert admit.mode == "admit" and admit.end(job, "cancel") is SegmentEnd.YIELDED  # a yield has no token yet
    slot = Segment(1, 2, admitted=True, asked=SegmentEnd.BACK_TO_SOLO)
    job.generated = [3]
    assert slot.mode == "slot" and slot.end(job, "cancel") is SegmentEnd.BACK_TO_SOLO
    job.cancelled = "disconnect"
    assert slot.end(job, "cancel") is SegmentEnd.FINISHED  # the client left: the job ends


class SentLines:
    """The engine as the scheduler sees it, recording the lines sent; it never answers."""

    alive = True

    def __init__(self, slots: int):
        self.lines: list[str] = []
        self.control: asyncio.Queue = asyncio.Queue()
        self.slot_queues = [asyncio.Queue() for _ in range(slots)]

    def send(self, line: str) -> None:
        self.lines.append(line)

    def words(self) -> list[str]:
        """The first word of each line sent."""
        return [line.split()[0] for line in self.lines]


def recording(slots: int, pipelined: bool = True) -> tuple[Scheduler, SentLines]:
    """A scheduler of `slots` slots over an engine that records what it is sent."""
    sch = scheduler(slots)
    sch.pipelined = pipelined
    sch.sup.engine = SentLines(slots)
    return sch, sch.sup.engine


async def settle() -> None:
    """Let the tasks the scheduler spawned run as far as they go."""
    for _ in range(3):
        await asyncio.sleep(0)


def stop(sch: Scheduler) -> None:
    for task in sch._tasks:
        task.cancel()


async def sent_for(burst: int, pipelined: bool) -> list[str]:
    """The first word of each line sent when `burst` requests reach the scheduler before any of their tasks run."""
    sch, engine = recording(4, pipelined)
    for i in range(burst):
        sch.submit(Job([10 + i, 1, 2], 5))
    await settle()
    stop(sch)
    return engine.words()


def test_a_burst_is_admitted_together_instead_of_its_first_going_solo():
    assert asyncio.run(sent_for(1, pipelined=True)) == ["GEN"]  # alone: the solo path
    assert asyncio.run(sent_for(3, pipelined=True)) == ["BGEN"] * 3  # the others came before its GEN went out
    assert asyncio.run(sent_for(3, pipelined=False)) == ["GEN"]  # exact mode: reads one at a time anyway


def test_requests_still_arriving_are_held_in_the_engine():
    """A burst's requests reach `submit` one at a time: while another is parsed and tokenized (`arriving`), the
    first goes into a slot behind HOLD (the engine parks what the slot held, and reads nothing), then the second,
    then GO; a request that fails while arriving ends the hold too. In exact mode the first waits here instead."""
    async def run(fails: bool, pipelined: bool = True) -> tuple[list[str], list[str]]:
        sch, engine = recording(4, pipelined)
        try:
            with sch.arriving():
                sch.submit(Job([10, 1, 2], 5))
                await settle()
                held = engine.words()
                if fails:
                    raise ValueError("a bad request")
            sch.submit(Job([11, 1, 2], 5))
        except ValueError:
            pass
        await settle()
        stop(sch)
        return held, engine.words()

    assert asyncio.run(run(fails=False)) == (["HOLD", "BGEN"], ["HOLD", "BGEN", "BGEN", "GO"])
    assert asyncio.run(run(fails=True)) == (["HOLD", "BGEN"], ["HOLD", "BGEN", "GO"])
    # exact mode: nothing while held; each request reads alone anyway (the second after the first)
    assert asyncio.run(run(fails=False, pipelined=False)) == ([], ["GEN"])


def test_without_slots_nothing_is_held():
    async def run() -> list[str]:
        sch, engine = recording(0, pipelined=False)
        with sch.arriving():
            sch.submit(Job([10, 1, 2], 5))
            await settle()
            sent = engine.words()
        stop(sch)
        return sent

    assert asyncio.run(run()) == ["GEN"]  # one request at a time anyway: it goes at once


def test_a_hold_for_arrivals_ends_after_its_time():
    async def run() -> tuple[list[str], list[str]]:
        sch, engine = recording(4)
        with sch.arriving():  # a request that takes longer than the hold
            sch.submit(Job([10, 1, 2], 5))
            sch.submit(Job([11, 1, 2], 5))
            await asyncio.sleep(HOLD_FOR_ARRIVALS_S + 0.05)
            after_hold = engine.words()
            sch.submit(Job([12, 1, 2], 5))  # still one arriving, but the hold ran out: no second one
            await settle()
        stop(sch)
        return after_hold, engine.words()

    assert asyncio.run(run()) == (["HOLD", "BGEN", "BGEN", "GO"], ["HOLD", "BGEN", "BGEN", "GO", "BGEN"])


def test_a_hold_that_ran_out_does_not_outlive_its_arrivals():
    """A hold whose waiting request left (cancelled) before its arrival ended: the next burst is held again."""
    async def run() -> list[str]:
        sch, engine = recording(4)
        with sch.arriving():
            gone = Job([10, 1, 2], 5)
            sch.submit(gone)
            sch.cancel(gone, "disconnect")
        await asyncio.sleep(HOLD_FOR_ARRIVALS_S + 0.05)
        first = len(engine.lines)
        with sch.arriving():
            sch.submit(Job([11, 1, 2], 5))
            await settle()
            held = engine.words()[first:]
        await settle()
        stop(sch)
        return engine.words()[:first], held

    assert asyncio.run(run()) == (["HOLD", "BGEN", "BSTOP", "GO"], ["HOLD", "BGEN"])


def test_a_hold_ends_with_go_when_its_waiting_request_left():
    """Both slots busy: a request waits behind HOLD, its client leaves, the other arrival fails. GO still goes out,
    so the next burst is held again (HOLD first)."""
    async def run() -> tuple[list[str], list[str]]:
        sch, engine = recording(2)
        sch.slots[0].job, sch.slots[1].job = Job([1], 5), Job([2], 5)  # both decoding
        gone = Job([10, 1, 2], 5)
        try:
            with sch.arriving():  # a route that fails
                sch.submit(gone)  # no free slot: HOLD, then it waits
                await settle()
                sch.cancel(gone, "disconnect")
                raise ValueError("a bad request")
        except ValueError:
            pass
        await settle()
        first = engine.words()
        sch.slots[0].job = sch.slots[1].job = None
        with sch.arriving():
            sch.submit(Job([20, 1, 2], 5))
            await settle()
        sch.submit(Job([21, 1, 2], 5))
        await settle()
        stop(sch)
        return first, engine.words()[len(first):]

    assert asyncio.run(run()) == (["HOLD", "GO"], ["HOLD", "BGEN", "BGEN", "GO"])
