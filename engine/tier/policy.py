"""The adaptation policy: which uncached experts replace which cached ones in a round.

Per layer, the uncached experts by routing count (most first) are paired with the cached slots by
count (least first; an empty slot counts as nothing cached); a pair is a swap while the hot count is
above zero and at least `min_gain` times the cold one and `min_count` (against an empty slot or a
cached expert whose count is 0, never routed or not for ~2,000 rounds of decay, any routed expert
will do). Over all layers at most `swaps` pairs are taken, those with the largest count difference
first (within a layer the differences only shrink along the pairs, so each layer gives up a prefix
of its pairs). Counts decay by `decay` after every round.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

FIXED = 1_000_000  # --adapt-every at or above this: the cache never changes after seeding (exact runs)
SEED_SWAPS = 1 << 30  # a seed round's cap: none


@dataclass(frozen=True)
class AdaptPolicy:
    every: int = 4  # windows between rounds; 0 = static
    swaps: int = 96  # most experts swapped in per round, all layers together
    decay: float = 0.7
    min_gain: float = 1.5
    min_count: float = 3.0  # routing count an expert needs to displace a cached one

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"--adapt-every must be >= 0, got {self.every}")
        if self.swaps < 0:
            raise ValueError(f"--adapt-swaps must be >= 0, got {self.swaps}")
        if not 0 < self.decay <= 1:
            raise ValueError(f"--adapt-decay must be in (0, 1], got {self.decay}")
        if self.min_gain < 1:
            raise ValueError(f"--adapt-min-gain must be >= 1, got {self.min_gain}")
        if self.min_count < 0:
            raise ValueError(f"--adapt-min-count must be >= 0, got {self.min_count}")

    @property
    def adapts(self) -> bool:
        return 0 < self.every < FIXED

    def seeding(self) -> AdaptPolicy:
        """A static cache's one seed round: the first windows' counts alone rank the experts (no cap, no
        gain or count to clear), so the adaptation options have no effect on a static cache."""
        return replace(self, swaps=SEED_SWAPS, min_gain=1.0, min_count=0.0)

    def due(self, window: int) -> bool:
        """Is a round due after `window` (1-based) windows?"""
        return self.adapts and window % self.every == 0


@dataclass(frozen=True)
class Swap:
    layer: int
    slot: int
    expert: int  # the expert copied in
    gain: float  # its count minus the count of the expert it replaces


def layer_swaps(layer: int, counts: torch.Tensor, expert_at: list[int], min_gain: float,
                min_count: float = 0.0) -> list[Swap]:
    """One layer's candidate swaps (see the module docstring)."""
    n = counts.tolist()
    cached = {e for e in expert_at if e >= 0}
    hot = sorted((e for e in range(len(n)) if e not in cached), key=lambda e: (-n[e], e))
    held = [n[e] if e >= 0 else None for e in expert_at]  # None: an empty slot
    cold = sorted(range(len(expert_at)), key=lambda s: (held[s] is not None, held[s] or 0.0, s))  # empty first
    swaps = []
    for expert, slot in zip(hot, cold, strict=False):
        h, c = n[expert], held[slot]
        if h <= 0 or (c and h < max(min_count, min_gain * c)):  # c None or 0: nothing routed to displace
            break
        swaps.append(Swap(layer, slot, expert, h - (c or 0.0)))
    return swaps


def plan_round(counts: torch.Tensor | list[torch.Tensor], expert_at: list[list[int]], policy: AdaptPolicy
               ) -> list[Swap]:
    """The swaps of one round over every layer (`counts`: a row per layer), at most `policy.swaps` (empty
    slots are filled whatever the cap: a fill evicts nothing)."""
    fills: list[Swap] = []
    swaps: list[Swap] = []
    for layer, (c, at) in enumerate(zip(counts, expert_at, strict=True)):
        for s in layer_swaps(layer, c, at, policy.min_gain, policy.min_count):
            (fills if at[s.slot] < 0 else swaps).append(s)
    swaps.sort(key=lambda s: -s.gain)  # stable: ties keep layer order
    return fills + swaps[: policy.swaps]
