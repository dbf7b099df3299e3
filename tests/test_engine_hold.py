"""HOLD and GO (`EngineLoop.holding`, `prepare`): admissions that come between them are made ready (their slots'
conversations parked, their prefixes found) but not read; GO reads them together in one forward, with the tokens
they get unheld. A hold without its GO ends by itself, and at the end of input."""

from __future__ import annotations

import time

import pytest
from forwards import forwards

from engine import loop as engine_loop
from engine import protocol as P
from engine.check import Driver, bgen, collect
from engine.hashlm import Rule, write_hashlm

PROMPTS = [list(b"a long first prompt of the burst"), list(b"a second one"), list(b"third"),
           list(b"and a fourth, of medium length")]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_hashlm(tmp_path_factory.mktemp("hashlm") / "hashlm.gguf")


@pytest.fixture
def driver(path):
    d = Driver.load(str(path), slots=4, exact=False, prefill=256)
    d.lines, d.hooks = [], []
    return d


def send(driver: Driver, *lines: str) -> None:
    """Queue `lines` and let the loop take them in as its main loop does, without reading or decoding."""
    driver.server.quit = False  # a `Driver.run` before ended with the end of input
    for line in lines:
        driver.server.commands.put(line)
    driver.server.poll()
    driver.server.admit()


def test_held_admissions_are_made_ready_then_read_together_after_go(driver, monkeypatch):
    first = collect(driver.run([bgen(0, PROMPTS[0], 6)])).slots[0]
    seen = forwards(driver, monkeypatch)
    follow_up = PROMPTS[0] + first + list(b" and then?")  # continues slot 0's conversation
    burst = [follow_up, *PROMPTS[1:]]
    driver.lines = []
    send(driver, "HOLD", *(bgen(i, ids, 6) for i, ids in enumerate(burst)))
    loop = driver.server
    assert seen == [] and not loop.reading  # nothing read while held
    assert [job.prepared for job in loop.pending] == [True] * 4
    resumed = loop.pending[0].reused
    assert resumed > 0 and driver.lines == [f"RESUME {resumed}"]  # its prefix found in the hold
    got = collect(driver.run(["GO"])).slots
    assert [got[i] for i in range(4)] == [Rule().reply(ids, 6)[0] for ids in burst]
    assert seen[0] == [0, 1, 2, 3]  # one forward for the whole burst


def test_a_hold_without_its_go_ends_by_itself(driver, monkeypatch):
    monkeypatch.setattr(engine_loop, "HOLD_LIMIT_S", 0.2)
    t0 = time.perf_counter()
    send(driver, "HOLD", bgen(1, PROMPTS[1], 4))
    assert not driver.server.reading
    driver.server.poll()  # waits for a command until the hold's limit
    driver.server.admit()
    assert driver.server.reading and time.perf_counter() - t0 >= 0.2
    assert collect(driver.run([])).slots[1] == Rule().reply(PROMPTS[1], 4)[0]


def test_the_end_of_input_ends_a_hold(driver, monkeypatch):
    monkeypatch.setattr(engine_loop, "HOLD_LIMIT_S", 60.0)
    t0 = time.perf_counter()
    got = collect(driver.run(["HOLD", bgen(2, PROMPTS[2], 4)])).slots  # then the end of stdin, as at QUIT
    assert got[2] == Rule().reply(PROMPTS[2], 4)[0] and time.perf_counter() - t0 < 30


def test_bstop_ends_a_held_admission_when_the_hold_ends(driver):
    send(driver, "HOLD", bgen(0, PROMPTS[0], 6), bgen(1, PROMPTS[1], 6), "BSTOP 0")
    lines = driver.run(["GO"])
    assert "BADM 0 0" in lines and collect(lines).slots[1] == Rule().reply(PROMPTS[1], 6)[0]
    assert [P.parse_reply(ln).finish for ln in lines if ln.startswith("DONE")][0] == "cancel"


def test_slots_decode_while_admissions_are_held(driver):
    """A slot decoding when a hold begins goes on; the held admission is read only after GO."""
    loop, decoding, go_at = driver.server, PROMPTS[0], []

    def ready(line: str) -> bool:  # a window of slot 0 after the held admission was made ready: GO now
        if line.startswith("BT 0 ") and any(j.prepared for j in loop.pending):
            go_at.append(len(driver.lines))
            return True
        return False

    driver.hooks = [(lambda ln: ln.startswith("BT 0 "), ["HOLD", bgen(1, PROMPTS[2], 4)]), (ready, ["GO"]),
                    (lambda ln: ln == "BADM 1 1", [None])]  # then the end of input
    loop.commands.put(bgen(0, decoding, 24))
    loop.run()
    lines = driver.lines
    got = collect(lines).slots
    assert got[0] == Rule().reply(decoding, 24)[0] and got[1] == Rule().reply(PROMPTS[2], 4)[0]
    held_at = next(i for i, ln in enumerate(lines) if ln.startswith("BT 0 "))
    assert go_at and not any(ln.startswith("PP") for ln in lines[held_at:go_at[0]])  # no read while held
    assert lines.index("BADM 1 1") > go_at[0]


def test_a_held_admission_gives_way_before_its_first_chunk(path):
    """BYIELD of an admission held behind HOLD (the server's yield to a much shorter prompt behind it): at GO it
    gives way before reading anything, and the short one is read first."""
    long = list(b"a long prompt " * 8)
    d = Driver.load(str(path), slots=4, exact=False, prefill=16)
    lines = d.run(["HOLD", bgen(0, long, 4), "BYIELD 0", bgen(1, PROMPTS[2], 4), "GO"])
    assert lines.index("YIELDED 0 0") < next(i for i, ln in enumerate(lines) if ln.startswith("PP"))
    assert "BADM 0 0" in lines and collect(lines).slots[1] == Rule().reply(PROMPTS[2], 4)[0]
