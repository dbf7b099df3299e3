"""Slot choice (pick_slot) and the group interleaving, on the scheduler itself."""

from __future__ import annotations

from pathlib import Path

from server.engine_client import EngineSupervisor
from server.scheduler import Job, Scheduler, Slot


def scheduler(n: int, groups: int = 1) -> Scheduler:
    sch = Scheduler(EngineSupervisor(["true"], {}, Path("/dev/null"), 0), queue_limit=4)
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
