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
from engine.gguf_file import GGUFFile
from engine.loading import open_model, placement_of
from engine.loop import EngineLoop
from engine.models.base import Model
from engine.placement import plan_groups
from engine.runner import Runner
from engine.stop_tokens import stop_token_ids
from engine.tier.flags import add_tier_flags, plan_tier, setup_tier

Hook = tuple[Callable[[str], bool], list[str]]


class Driver:
    """One model, any number of scripted runs; each run starts with empty sessions."""

    def __init__(self, model: Model, stop_ids: frozenset[int], slots: int, exact: bool = True, prefill: int = 16,
                 decode_share: float = 0.5, groups: int = 1, ahead: bool | None = None):
        self.model, self.stop_ids, self.slots = model, stop_ids, slots
        self.exact, self.prefill, self.decode_share, self.groups = exact, prefill, decode_share, groups
        self.ahead = ahead  # windows queued ahead (`Runner.queue`); None: where the runner chooses (CUDA)
        self.lines: list[str] = []
        self.hooks: list[Hook] = []
        self.server = self._fresh()

    @classmethod
    def load(cls, path: str, slots: int, device: str = "cpu", context: int = 1024, dtype: str | None = None,
             kv: str | None = None, layer_split: str = "", host_experts: bool | str = False, **kw) -> Driver:
        g, model = open_model(path, device, dtype, slots, context, max_chunk=kw.get("prefill", 16), kv=kv,
                              layer_split=layer_split, host_experts=host_experts)
        return cls(model, stop_token_ids(g.metadata), slots, **kw)

    def _fresh(self) -> EngineLoop:
        return EngineLoop(Runner(self.model, self.slots, self.exact, self.groups, ahead=self.ahead), self.stop_ids,
                          self.prefill, self.decode_share, out=self)

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


def solo_and_batch(driver: Driver, prompts: list[list[int]], max_new: int, keys: str = "") -> list[tuple[list[int], list[int]]]:
    """Each prompt alone, then all together in slots: (solo tokens, batch tokens) per slot."""
    alone = []
    for ids in prompts:
        driver.reset()
        alone.append(collect(driver.run([gen(ids, max_new, keys)])).solo[0])
    driver.reset()
    together = collect(driver.run([bgen(i, ids, max_new, keys) for i, ids in enumerate(prompts)])).slots
    return [(solo, together.get(i, [])) for i, solo in enumerate(alone)]


def compare(driver: Driver, prompts: list[list[int]], max_new: int, keys: str = "") -> list[str]:
    """One failure message per slot whose batch tokens differ from its solo tokens."""
    failures = []
    for i, (solo, batch) in enumerate(solo_and_batch(driver, prompts, max_new, keys)):
        at = first_divergence(solo, batch)
        if at is not None:
            failures.append(f"slot {i}: first divergence at token {at}: solo {solo[at:at + 4]} batch {batch[at:at + 4]}")
    return failures


def agreement(driver: Driver, prompts: list[list[int]], max_new: int, keys: str = "") -> tuple[int, int]:
    """(tokens equal to solo before each slot's first divergence, tokens in all): default mode's figure."""
    pairs = solo_and_batch(driver, prompts, max_new, keys)
    equal = sum(len(solo) if first_divergence(solo, batch) is None else first_divergence(solo, batch) for solo, batch in pairs)
    return equal, sum(len(solo) for solo, _ in pairs)


def main(argv: list[str] | None = None) -> int:
    from engine import scenarios  # it builds on this module's Driver

    p = argparse.ArgumentParser(prog="strata-desk check", description="batch-vs-solo token equality on your model")
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--slots", default="4", help="slot counts to compare, e.g. 2,4,8")
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--keys", default="", help="sampling keys, e.g. 'temperature=0.7 seed=7'")
    p.add_argument("--interleave", action="store_true",
                   help="also the interleave cases: " + ", ".join(scenarios.INTERLEAVES))
    p.add_argument("--runs", type=int, default=1, help="run everything this many times (kernels must not vary run to run)")
    p.add_argument("--default-mode", action="store_true",
                   help="also count how many tokens equal solo without --exact (a figure, not a pass)")
    p.add_argument("--layer-split", default="", help="as the engine's: '24', '12,24,36' or auto")
    p.add_argument("--batch-groups", default="1", help="as the engine's: G pipeline groups of the slots, or auto")
    add_tier_flags(p)
    args = p.parse_args(argv)
    try:
        counts = sorted({int(n) for n in args.slots.split(",")})
    except ValueError:
        p.error(f"--slots takes slot counts like 2,4,8, not {args.slots!r}")
    if counts[0] < 1 or args.runs < 1:
        p.error("--slots and --runs must be at least 1")
    slots = max(counts + ([3] if args.interleave else []))
    try:
        g = GGUFFile(args.model)
        plan = plan_tier(args, g, placement_of(g, args.device, args.layer_split))
        driver = Driver.load(args.model, slots, args.device, layer_split=args.layer_split,
                             host_experts=plan.host_experts)
        model = driver.model
        setup_tier(args, model)
        groups, note = plan_groups(args.batch_groups, slots, len(model.placement.stages))
    except (ValueError, OSError) as exc:
        p.error(str(exc))
    if note:
        print(note, flush=True)
    driver.groups = groups
    driver.reset()
    cases = scenarios.cases(counts, args.max_new, args.interleave)
    failed = 0
    with torch.inference_mode():
        for run in range(1, args.runs + 1):
            for name, case in cases.items():
                failures = case(driver, args.keys).failures
                failed += bool(failures)
                print(f"{'FAIL' if failures else 'PASS'} run {run}: {name}" + "".join(f"\n  {f}" for f in failures), flush=True)
        if args.default_mode:
            loose = Driver(driver.model, driver.stop_ids, slots, exact=False, groups=groups)
            for run in range(1, args.runs + 1):
                equal, total = agreement(loose, sample_prompts(driver.model.hyper.vocab, slots, seed=slots), args.max_new, args.keys)
                print(f"default mode run {run}: {equal} of {total} tokens equal to solo ({slots} slots)", flush=True)
    where = model.placement.describe() if model.placement.split else str(model.device)
    if model.tier is not None:
        where += f", expert tier ({model.tier.mode}, {model.tier.slots} of {model.tier.experts_total} experts cached)"
    mode = f"{where}, {groups} groups, exact mode, {'sampled: ' + args.keys if args.keys else 'greedy'}"
    total = args.runs * len(cases)
    print(f"{'PASS' if not failed else 'FAIL'}: {total - failed} of {total} runs gave batch tokens equal to solo tokens ({mode})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
