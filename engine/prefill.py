"""`--prefill N|auto|auto:MAX`: the prompt chunk size, and how `auto` picks it on a GPU.

A bigger chunk reads a prompt faster on a GPU: each pass over the weights serves more tokens, and with
an expert tier each layer streams its missed experts once a chunk instead of once every 512 tokens
(on an H200, 4,096 tokens at half the experts cached: 5,719 tok/s in chunks of 512, 19,053 in one).
It also takes more VRAM at its peak. So `auto` reads one chunk of `PROBE` tokens at start, measures the
VRAM it took at its peak, and takes the largest power of two up to MAX (`PREFILL_AUTO_MAX`, as upstream's) and
the context whose peak, in proportion, fits in the VRAM free beside the weights, the KV, the slots and
the expert cache. The cache is not shrunk for it (upstream's prompt chunks borrow cache slots instead;
see docs/protocol.md). On the CPU `auto` keeps `PROBE`: there a chunk's speed hardly moves with its size.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from engine.memory import MIB, free_bytes
from engine.protocol import PREFILL_AUTO_MAX
from engine.runner import Runner

PROBE = 512  # the chunk `auto` measures, and its smallest choice
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


def largest_chunk(per_token: float, free: int, most: int) -> int:
    """The largest power of two from `PROBE` up to `most` whose `per_token` peak fits in `free` bytes
    (`PROBE` itself when none does, `most` when it is smaller)."""
    chunk = min(PROBE, most)
    while chunk * 2 <= most and chunk * 2 * per_token <= free * HEADROOM:
        chunk *= 2
    return chunk


def read_peak(runner: Runner, tokens: int = PROBE) -> float:
    """VRAM bytes a prompt token took at the peak of a `tokens`-token read into the solo session (the
    device that peaked most, over what was allocated before). The session is emptied after it, and an
    expert tier forgets the read's routing."""
    model = runner.model
    devices = model.placement.devices()
    before = {d: torch.cuda.memory_allocated(d) for d in devices}
    for d in devices:
        torch.cuda.reset_peak_memory_stats(d)
    runner.read(runner.solo, [1 + i % (model.hyper.vocab - 1) for i in range(tokens)])
    for d in devices:
        torch.cuda.synchronize(d)
    runner.solo.tokens = []
    if model.tier is not None:
        for layer in model.tier.layers:
            layer.reset_counts()
    return max(torch.cuda.max_memory_allocated(d) - before[d] for d in devices) / tokens


def choose_prefill(runner: Runner, ask: PrefillAsk) -> tuple[int, str]:
    """The chunk the engine reads prompts in, and the start's line saying why. Call it with nothing else
    on the device: `auto` reads a chunk to measure it, on a GPU."""
    devices = runner.model.placement.devices()
    most = min(ask.most(devices[0]), runner.model.context)
    if not ask.auto:
        return most, f"prompt chunks of {most} tokens"
    if devices[0].type != "cuda":
        return most, f"--prefill {ask}: chunks of {most} tokens (the CPU's choice)"
    per_token = read_peak(runner, min(PROBE, most))
    free = min(free_bytes(d)[0] + torch.cuda.memory_reserved(d) - torch.cuda.memory_allocated(d) for d in devices)
    chunk = largest_chunk(per_token, free, most)
    return chunk, (f"--prefill {ask}: chunks of {chunk} tokens ({per_token * chunk / MIB:.0f} MiB at the peak, "
                   f"measured on {PROBE}; {free / MIB:.0f} MiB free)")
