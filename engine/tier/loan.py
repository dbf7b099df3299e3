"""Prompt chunks borrow expert-cache slots for their MoE buffers (as upstream; `--no-prefill-borrow`
reserves that VRAM beside the cache instead).

A device's cache slots are views into one uint8 tensor (`SlotArena`): each layer's three projection
buffers after the layer before's. A prompt chunk's SwiGLU rows and expert outputs (`triton_moe.Outputs`:
pairs x (expert FFN + hidden) values, 352 MiB for 8,192 tokens of Qwen3-30B-A3B) take the arena's tail
(`Lender.outputs`). The slots that tail overlaps are evicted first, so the chunk streams their experts
as it streams its other misses (same kernel, same bits), and `repay` copies what was overwritten back
from host memory and publishes the experts again before the next decode window (`Tier.window_start`).
A loan is kept from one chunk to the next (a long prompt's chunks pay for one refill), and grows when a
chunk needs more.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from engine.kernels import triton_moe
from engine.tier.gpu_slots import GpuLayerSlots
from engine.tier.sizing import ALIGN, aligned, outputs_bytes


class SlotArena:
    """Buffers of the given shapes, uint8, one after another in one tensor on `device`."""

    def __init__(self, shapes: list[tuple[int, ...]], device: torch.device):
        self.ranges: list[tuple[int, int]] = []
        at = 0
        for shape in shapes:
            at = aligned(at)
            self.ranges.append((at, at + math.prod(shape)))
            at += math.prod(shape)
        self.data = torch.empty(at, dtype=torch.uint8, device=device)
        self.buffers = [self.data[a:b].view(shape) for (a, b), shape in zip(self.ranges, shapes, strict=True)]

    @property
    def size(self) -> int:
        return self.data.numel()


class Lender:
    """Lends prompt chunks the tail of one device's `SlotArena`, whose buffers are `layers`' (three each,
    in order)."""

    def __init__(self, arena: SlotArena, layers: list[GpuLayerSlots]):
        if len(arena.ranges) != 3 * len(layers):
            raise ValueError(f"the arena holds {len(arena.ranges)} buffers, not three for each of {len(layers)} layers")
        self.arena, self.layers = arena, layers
        self.settle: Callable[[], None] = lambda: None  # the tier's: a round's copies land before a loan
        self._start = arena.size  # the loan's first byte (the arena's size: nothing lent)
        self._owed: dict[tuple[int, int], tuple[int, set[int]]] = {}  # (layer, slot) -> (expert, projections)
        self.loans = 0  # loans taken (a loan grown counts again)
        self.largest = 0  # bytes of the largest loan
        self.refilled = 0  # bytes copied back by `repay`

    @property
    def lent(self) -> int:
        return self.arena.size - self._start

    def outputs(self, pairs: int, ffn: int, hidden: int, like: torch.Tensor) -> triton_moe.Outputs | None:
        """A chunk's buffers for `pairs` pairs (rows like `like`) in the arena's tail, its slots evicted;
        None when they do not fit in the arena (the caller allocates them)."""
        need = outputs_bytes(pairs, ffn, hidden, like.dtype)
        start = (self.arena.size - need) // ALIGN * ALIGN
        if start < 0:
            return None
        if start < self._start:
            self._lend(start)
        size = like.dtype.itemsize
        h_at, y_at = start, start + aligned(pairs * ffn * size)
        h = self.arena.data[h_at : h_at + pairs * ffn * size].view(like.dtype).view(pairs, ffn)
        y = self.arena.data[y_at : y_at + pairs * hidden * size].view(like.dtype).view(pairs, hidden)
        return triton_moe.Outputs(h, y)

    def _lend(self, start: int) -> None:
        """Evict every slot with bytes in [start, the loan's start), remembering what to copy back."""
        self.settle()
        for index, layer in enumerate(self.layers):
            for projection in range(3):
                a, b = self.arena.ranges[3 * index + projection]
                if b <= start or a >= self._start:
                    continue
                slot_bytes = layer.buffers[projection][0].numel()
                for slot in range(max(0, (start - a) // slot_bytes), layer.size):
                    if a + slot * slot_bytes >= self._start:
                        break
                    expert, projections = self._owed.get((index, slot), (layer.expert_at[slot], set()))
                    if expert < 0:  # empty: nothing to copy back
                        continue
                    layer.evict(slot)
                    projections.add(projection)
                    self._owed[(index, slot)] = (expert, projections)
        self._start = start
        self.loans += 1
        self.largest = max(self.largest, self.lent)

    def repay(self) -> None:
        """Copy the overwritten projections of the evicted slots back (on the current stream: after the
        chunks' kernels, before the next window's) and publish their experts again."""
        for (index, slot), (expert, projections) in self._owed.items():
            layer = self.layers[index]
            layer.fill(slot, expert, tuple(sorted(projections)))
            layer.publish(slot, expert)
            self.refilled += sum(layer.buffers[p][0].numel() for p in projections)
        self._owed.clear()
        self._start = self.arena.size
