"""Warm-up before READY on a GPU: the kernels the first requests launch are compiled at start.

Triton compiles a kernel the first time it runs with new constants, and specializes each integer
argument on whether it is 1 or a multiple of 16. Without this, on an H200 machine with a fresh
install, the first request took 47 s and the first window of two rows stalled the server for 61 s,
all of it compiling. Compiled kernels are cached on disk (Triton's cache, ~/.triton), so later starts
spend well under a second here; the first start spends that time in the engine's start instead.

`warm_up` reads prompt chunks of the shapes a read comes in (the whole chunk from position 0, then a
length and a position that are not multiples of 16) and decodes windows of every row count the
sessions allow, twice each (the second is captured as a CUDA graph, `engine/cuda_graphs.py`), then
forgets all of it. Between them it copies what the reads left into another session and parks and restores it
(`KVCache.copy`, `save`, `load`: on one GPU a Triton launch each, which the first requests that share a prefix
or park a conversation would otherwise compile, ~0.2 s each on an H100).
"""

from __future__ import annotations

import time

from engine.protocol import Sampling
from engine.runner import Row, Runner

ODD_READS = (37, 100)  # a length not a multiple of 16 at one that is, then an even one at an odd position
FIRST_TOKEN = 1  # any token id of the vocabulary


def needed(runner: Runner) -> bool:
    """Whether the model runs compiled GPU kernels (on the CPU the C kernels are built at import)."""
    return runner.model.placement.on_gpu()


def warm_up(runner: Runner) -> float:
    """Run the reads and windows above; the seconds they took (each window's tokens are read back, so the device
    has done its work). Every session is left empty."""
    t0 = time.perf_counter()
    model = runner.model
    vocab = model.hyper.vocab
    solo = runner.solo
    try:
        for reads in ((runner.chunk,), ODD_READS):
            runner.forget()
            for length in reads:
                length = min(length, model.context - len(solo.tokens) - 1)
                if length > 0:
                    runner.read(solo, [1 + (len(solo.tokens) + i) % (vocab - 1) for i in range(length)])
        _copy_and_park(runner)
        greedy = Sampling()
        for rows in range(1, len(runner.sessions) + 1):
            runner.forget()  # with an expert tier, the slots the reads borrowed come back first, as in a window's start
            for _ in range(2):  # eager, then captured
                runner.decode([Row(s, FIRST_TOKEN, greedy, 1) for s in runner.sessions[-rows:]])
    finally:
        runner.forget()
    return time.perf_counter() - t0


def _copy_and_park(runner: Runner) -> None:
    """The solo session's positions copied into another session, then parked and restored there; all of them and all
    but one (the copies' word can hang on a count's parity: Q8_0 rows of 68 or 102 bytes)."""
    kv, solo = runner.model.kv, runner.solo
    other = next((s for s in runner.sessions if s is not solo), None)
    if other is None:
        return
    held = len(solo.tokens)
    for n in (held, held - 1):
        if n > 0:
            kv.copy(solo.index, other.index, n)
            kv.load(other.index, *kv.save(solo.index, n, pin=kv.k[0].is_cuda), n)
