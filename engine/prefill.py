"""`--prefill N|auto|auto:MAX`: the prompt chunk size, and how `auto` picks it on a GPU.

A bigger chunk reads a prompt faster on a GPU: each pass over the weights serves more tokens, and with
an expert tier each layer streams its missed experts once a chunk instead of once every 512 tokens
(on an H200, 4,096 tokens at half the experts cached: 6,317 tok/s in chunks of 512, 19,293 in one).
It also takes more VRAM at its peak. So `auto` reads chunks at start, largest first, each where a chunk
costs most (at the end of the context: its attention then sees every key), and takes the first whose
measured peak fits in nine tenths of the VRAM free beside the weights, the KV, the slots and the expert
cache: the powers of two from `PROBE` up to MAX (`PREFILL_AUTO_MAX`, as upstream's) and the context.
With the GPU expert tier a chunk's MoE buffers borrow cache slots (`engine.tier.loan`), so its peak
counts the rest. On the CPU `auto` keeps `PROBE`: there a chunk's speed hardly moves with its size.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from engine.memory import MIB, free_bytes
from engine.protocol import PREFILL_AUTO_MAX
from engine.runner import Runner

PROBE = 512  # the smallest chunk `auto` picks
HEADROOM = 0.9  # of the free VRAM a chunk's peak may take: the allocator's blocks round up


@dataclass(frozen=True)
class PrefillAsk:
    """What `--prefill` asked: a chunk of `tokens`, or (`auto`) the largest that fits up to `tokens`."""

    tokens: int
    auto: bool = False

    def __str__(self) -> str:
        return f"auto:{self.tokens}" if self.auto else str(self.tokens)

    def most(self, device: torch.device) -> int:
        """The largest chunk it can come to on `device` (what the KV rings and buffers are sized for)."""
        return min(self.tokens, PROBE) if self.auto and device.type != "cuda" else self.tokens


def parse_prefill(text: str) -> PrefillAsk:
    """`512`, `auto` or `auto:16384`; a clear error for anything else."""
    head, colon, tail = text.partition(":")
    auto = head == "auto"
    if text == "auto":
        return PrefillAsk(PREFILL_AUTO_MAX, auto=True)
    number = tail if auto else head
    if not number.isdigit() or (colon and not auto):
        raise ValueError(f"--prefill must be a number of tokens, auto or auto:MAX, got {text!r}")
    tokens = int(number)
    if tokens < 1:
        raise ValueError(f"--prefill must be at least 1 token, got {text!r}")
    return PrefillAsk(tokens, auto)


def prefill_flag(text: str) -> PrefillAsk:
    """`parse_prefill` as an argparse type (the engine's and bench-engine's `--prefill`)."""
    try:
        return parse_prefill(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--prefill ")) from exc


def candidates(most: int) -> list[int]:
    """The chunks `auto` tries, largest first: the powers of two from `PROBE` up to `most` (`most` alone
    when it is smaller)."""
    if most <= PROBE:
        return [most]
    sizes = [PROBE]
    while sizes[-1] * 2 <= most:
        sizes.append(sizes[-1] * 2)
    return sizes[::-1]


def read_peak(runner: Runner, tokens: int) -> int:
    """VRAM bytes a `tokens`-token chunk takes at its peak where a chunk costs most: read into the solo
    session at the end of the context (its attention over every key before it; those keys were never
    written, only their memory counts). The device that peaked most, over what was allocated before it.
    The session is emptied after it, and an expert tier forgets the read's routing and gets its borrowed
    slots back."""
    model = runner.model
    devices = model.placement.devices()
    before = {d: torch.cuda.memory_allocated(d) for d in devices}
    for d in devices:
        torch.cuda.reset_peak_memory_stats(d)
    runner.solo.tokens = [0] * (model.context - tokens)
    try:
        runner.read(runner.solo, [1 + i % (model.hyper.vocab - 1) for i in range(tokens)])
        for d in devices:
            torch.cuda.synchronize(d)
    finally:
        runner.forget()
    return max(torch.cuda.max_memory_allocated(d) - before[d] for d in devices)


def choose_prefill(runner: Runner, ask: PrefillAsk) -> tuple[int, str]:
    """The chunk the engine reads prompts in, and the start's line saying why. Call it with nothing else
    on the device: `auto` reads chunks to measure them, on a GPU (largest first, until one fits)."""
    devices = runner.model.placement.devices()
    most = min(ask.most(devices[0]), runner.model.context)
    if not ask.auto:
        return most, f"prompt chunks of {most} tokens"
    if devices[0].type != "cuda":
        return most, f"--prefill {ask}: chunks of {most} tokens (the CPU's choice)"
    free = min(free_bytes(d)[0] + torch.cuda.memory_reserved(d) - torch.cuda.memory_allocated(d) for d in devices)
    tried = []
    for chunk in candidates(most):
        try:
            peak = read_peak(runner, chunk)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            tried.append(f"{chunk}: out of memory")
            continue
        if peak <= free * HEADROOM:
            return chunk, (f"--prefill {ask}: chunks of {chunk} tokens ({peak / MIB:.0f} MiB at the peak of one at "
                           f"the end of the context, of {free / MIB:.0f} MiB free)")
        tried.append(f"{chunk}: {peak / MIB:.0f} MiB")
    chunk = candidates(most)[-1]
    return chunk, (f"--prefill {ask}: chunks of {chunk} tokens, though none leaves a tenth of the {free / MIB:.0f} "
                   f"MiB free at the end of the context ({'; '.join(tried)}): a long prompt may run out of memory")
