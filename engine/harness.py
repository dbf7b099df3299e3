"""`python -m engine.harness [switches] --serve --model X.gguf ...`: the real engine, slowed down or
broken on purpose, for the tests of the server, the dashboard and the CLI.

Everything is the engine of `python -m engine` (EngineLoop, Runner, sessions, the protocol), usually
over a HashLM file (engine/hashlm.py); the switches (`Switches`, given before the engine's own flags)
only pace the runner and watch the loop's output. `command(...)` is the `engine_command` of a run
config that uses them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, fields
from functools import partial
from typing import Any

import torch

from engine import protocol as P
from engine.__main__ import main as engine_main
from engine.loading import log
from engine.loop import EngineLoop, Job
from engine.models.base import Model
from engine.runner import Queued, Row, Runner, Session


@dataclass(frozen=True)
class Switches:
    tok_s: float = 0.0  # at most this many decode steps a second (0: as fast as it goes)
    prefill_tok_s: float = 0.0  # at most this many prompt tokens read a second (0: as fast as it goes)
    hold_until: str | None = None  # wait for this file to exist before loading (at most HOLD_MAX_S): the
    # server sees a slow start for as long as a test needs it
    die_after: int = 0  # exit (code 3, a CUDA-like error on stderr) at the Nth generated token (T or BT)
    silent_after: int = 0  # write nothing more after the Nth generated token, and stay alive
    admission_log: str | None = None  # a JSON line per read started: kind, slot, prompt, reused, reading (itself too)
    ahead: int = 0  # 1: decode windows queued ahead (`Runner.queue`) on the CPU too, as on CUDA


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def command(**switches: Any) -> list[str]:
    """The engine program with `switches` (named as the fields of `Switches`), for `engine_command`."""
    Switches(**switches)  # refuses an unknown name
    out = [sys.executable, "-m", "engine.harness"]
    for name, value in switches.items():
        out += [_flag(name), str(value)]
    return out


def parse(argv: list[str]) -> tuple[Switches, list[str]]:
    """The switches, and the engine's own arguments that follow or surround them."""
    p = argparse.ArgumentParser(prog="python -m engine.harness", allow_abbrev=False,
                                description="the engine with test switches; other arguments go to the engine")
    for f in fields(Switches):
        p.add_argument(_flag(f.name), dest=f.name, default=f.default,
                       type=str if f.default is None else type(f.default))
    known, rest = p.parse_known_args(argv)
    return Switches(**vars(known)), rest


def _pace(started: float, seconds: float) -> None:
    """Sleep until `seconds` have passed since `started` (a perf_counter time)."""
    left = started + seconds - time.perf_counter()
    if left > 0:
        time.sleep(left)


class PacedRunner(Runner):
    """The runner at most as fast as the switches allow: a decode step and a prompt read take at
    least their share of a second."""

    def __init__(self, model: Model, n_slots: int, exact: bool, groups: int = 1, graphs: bool = True, *,
                 switches: Switches, plans: bool = True):
        super().__init__(model, n_slots, exact, groups, graphs, ahead=True if switches.ahead else None, plans=plans)
        self.step_s = 1 / switches.tok_s if switches.tok_s else 0.0
        self.read_token_s = 1 / switches.prefill_tok_s if switches.prefill_tok_s else 0.0

    def read_parts(self, parts: list[tuple[Session, list[int]]]) -> torch.Tensor:
        started = time.perf_counter()
        logits = super().read_parts(parts)
        _pace(started, sum(len(ids) for _, ids in parts) * self.read_token_s)
        return logits

    def decode(self, rows: list[Row]) -> list[int]:
        started = time.perf_counter()
        tokens = super().decode(rows)
        _pace(started, self.step_s)
        return tokens

    def queue(self, rows: list[Row], after: Queued | None = None) -> Queued:
        started = time.perf_counter()
        window = super().queue(rows, after)
        _pace(started, self.step_s)
        return window


class HarnessLoop(EngineLoop):
    """The protocol loop with the fault switches on its output and the admission log on its reads."""

    def __init__(self, *args: Any, switches: Switches, **kw: Any):
        super().__init__(*args, **kw)
        self.switches = switches
        self.generated = 0
        self.silent = False

    def emit(self, reply: P.Reply) -> None:
        if self.silent:
            return
        super().emit(reply)
        if not isinstance(reply, P.Token | P.BToken):
            return
        self.generated += 1
        if self.generated == self.switches.die_after:
            log("CUDA error: an illegal memory access was encountered (--die-after)")
            os._exit(3)
        if self.generated == self.switches.silent_after:
            log("writing nothing more (--silent-after)")
            self.silent = True

    def start_read(self, job: Job) -> None:
        super().start_read(job)
        if not self.switches.admission_log:
            return
        record = {"kind": "GEN" if job.slot is None else "BGEN", "slot": job.slot, "prompt": len(job.prompt),
                  "reused": job.reused, "reading": len(self.reading)}
        with open(self.switches.admission_log, "a") as fh:
            fh.write(json.dumps(record) + "\n")


HOLD_MAX_S = 120.0  # a held engine loads anyway after this long (a test that never releases it)


def _hold(path: str) -> None:
    deadline = time.monotonic() + HOLD_MAX_S
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)


def main(argv: list[str] | None = None) -> int:
    switches, engine_argv = parse(sys.argv[1:] if argv is None else argv)
    if switches.hold_until:
        _hold(switches.hold_until)
    return engine_main(engine_argv, partial(PacedRunner, switches=switches),
                       partial(HarnessLoop, switches=switches))


if __name__ == "__main__":
    sys.exit(main())
