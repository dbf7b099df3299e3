"""Batch-vs-solo comparison in one process: `strata-desk check --model X.gguf [--device ...]`.

`Driver` runs the protocol loop over an in-memory script: commands go in, reply lines come out, and
`when` hooks send more commands the moment a given reply is written (e.g. BYIELD after the first
prompt chunk), which makes interleavings deterministic. The tests use the same driver.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine import protocol as P
from engine.loading import open_model
from engine.loop import EngineLoop
from engine.models.base import Model
from engine.runner import Runner
from engine.stop_tokens import stop_token_ids

Hook = tuple[Callable[[str], bool], list[str]]


class Driver:
    """One model, any number of scripted runs; each run starts with empty sessions."""

    def __init__(self, model: Model, stop_ids: frozenset[int], slots: int, exact: bool = True, prefill: int = 16,
                 decode_share: float = 0.5):
        self.model, self.stop_ids, self.slots = model, stop_ids, slots
        self.exact, self.prefill, self.decode_share = exact, prefill, decode_share
        self.lines: list[str] = []
        self.hooks: list[Hook] = []
        self.server = self._fresh()

    @classmethod
    def load(cls, path: str, slots: int, device: str = "cpu", context: int = 1024, dtype: str | None = None,
             kv: str | None = None, **kw) -> Driver:
        g, model = open_model(path, device, dtype, slots, context, max_chunk=kw.get("prefill", 16), kv=kv)
        return cls(model, stop_token_ids(g.metadata), slots, **kw)

    def _fresh(self) -> EngineLoop:
        return EngineLoop(Runner(self.model, self.slots, self.exact), self.stop_ids, self.prefill, self.decode_share, out=self)

    def reset(self) -> None:
        """Forget every held session (a fresh engine, the model kept)."""
        self.server = self._fresh()

    # the loop writes its replies here
    def write(self, text: str) -> None:
        for line in text.splitlines():
            self.lines.append(line)
            for hook in list(self.hooks):
                if hook[0](line):
                    self.hooks.remove(hook)
                    for cmd in hook[1]:
                        self.server.commands.put(cmd)

    def flush(self) -> None:
        pass

    def run(self, commands: list[str], hooks: list[Hook] = ()) -> list[str]:
        """Send `commands` (and whatever the hooks add), run until idle, return the reply lines."""
        self.lines = []
        self.hooks = list(hooks)
        for cmd in commands:
            self.server.commands.put(cmd)
        self.server.commands.put(None)  # end of input: the loop exits once everything is done
        self.server.quit = False
        self.server.run()
        return [line for line in self.lines if not line.startswith("STATS")]


@dataclass
class Streams:
    """Tokens per request: solo requests under key -1 in order, slots under their slot number."""

    solo: list[list[int]]
    slots: dict[int, list[int]]


def collect(lines: list[str]) -> Streams:
    solo: list[list[int]] = []
    current: list[int] = []
    slots: dict[int, list[int]] = {}
    pending_first: list[int] = []
    for line in lines:
        reply = P.parse_reply(line)
        match reply:
            case P.Token(i):
                current.append(i)
            case P.Done():
                solo.append(current)
                pending_first = current
                current = []
            case P.BAdm(slot, _):
                slots[slot] = list(pending_first)
                solo.pop()
            case P.BToken(slot, i):
                slots[slot].append(i)
    return Streams(solo, slots)


def gen(ids: list[int], max_new: int, keys: str = "") -> str:
    return P.format_command(P.Gen(max_new, tuple(ids), _sampling(keys)))


def bgen(slot: int, ids: list[int], max_new: int, keys: str = "") -> str:
    return P.format_command(P.BGen(slot, max_new, tuple(ids), _sampling(keys)))


def _sampling(keys: str) -> P.Sampling:
    """`"temperature=0.7 seed=3"` -> Sampling, through the protocol's own parser."""
    return P.parse_command(f"GEN 1 {keys} 0").sampling


def sample_prompts(vocab: int, n: int, seed: int = 0, lo: int = 8, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(driver: Driver, prompts: list[list[int]], max_new: int, keys: str = "") -> list[str]:
    """Each prompt alone, then all together in slots; returns one failure message per divergence."""
    alone = []
    for ids in prompts:
        driver.reset()
        alone.append(collect(driver.run([gen(ids, max_new, keys)])).solo[0])
    driver.reset()
    together = collect(driver.run([bgen(i, ids, max_new, keys) for i, ids in enumerate(prompts)])).slots
    failures = []
    for i, solo in enumerate(alone):
        at = first_divergence(solo, together.get(i, []))
        if at is not None:
            failures.append(f"slot {i}: first divergence at token {at}: solo {solo[at:at + 4]} batch {together.get(i, [])[at:at + 4]}")
    return failures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="strata-desk check", description="batch-vs-solo token equality on your model")
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--keys", default="", help="sampling keys, e.g. 'temperature=0.7 seed=7'")
    args = p.parse_args(argv)
    driver = Driver.load(args.model, args.slots, args.device)
    prompts = sample_prompts(driver.model.hyper.vocab, args.slots)
    with torch.inference_mode():
        failures = compare(driver, prompts, args.max_new, args.keys)
    for f in failures:
        print("FAIL", f)
    if not failures:
        print(f"PASS: {args.slots} conversations of {args.max_new} tokens, batch tokens equal solo tokens ({driver.model.device}, exact mode)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
