"""Run to run across engine restarts: what one script's streams are in a fresh engine process."""

import os
import subprocess
import sys
from pathlib import Path

from engine.check import collect

SAMPLED = "temperature=0.9 top_k=40 seed=5"
ALONE = ["GEN 12 5,6,7,8", f"GEN 12 {SAMPLED} 5,6,7,8"]  # the solo path, one request after the other
# the admissions first: an admission's first token is a `T` line like a solo request's, so one read while a
# solo request decodes would mix their `T` lines on the wire, in an order that depends on timing
TOGETHER = ["BGEN 0 12 9,10,11", f"BGEN 1 12 {SAMPLED} 12,13,14", *ALONE]


def streams(model: Path, commands: list[str], hash_seed: str, *args: str) -> tuple[list[list[int]], dict[int, list[int]]]:
    """(solo streams in order, slot streams) of `commands` in a new engine with `--batch 2` and `args`."""
    out = subprocess.run(
        [sys.executable, "-m", "engine", "--serve", "--batch", "2", *args, "--model", str(model)],
        input="\n".join([*commands, "QUIT"]) + "\n", capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONHASHSEED": hash_seed})
    assert out.returncode == 0, out.stderr
    # per stream: when a later command is read (between which steps) may differ run to run
    got = collect(out.stdout.splitlines())
    assert len(got.solo) == 2, out.stdout
    return got.solo, got.slots
