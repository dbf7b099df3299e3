"""One layer's expert cache: N slots, each a copy of one expert's three matrices, and the slot table.

`slot_of` (int32 `[experts]`, the slot holding each expert or -1) is the table a fused MoE kernel
reads; `expert_at[s]` is its inverse (-1: the slot is empty). A swap is three steps so that a copy
can run elsewhere (a CUDA stream driven by a helper thread) while the layer keeps serving:
`evict` (the table forgets the slot's expert: its entries become misses at once), `fill` (the copy
into the slot's buffers), `publish` (the table points the new expert at the slot). On the simulated
tier the slots are host buffers and `fill` is a plain copy.
"""

from __future__ import annotations

import torch

from engine.experts import swiglu
from engine.tier.slot_linear import linear_over, storage_of
from engine.weights import Linear, LinearStack


class LayerSlots:
    def __init__(self, gate: LinearStack, up: LinearStack, down: LinearStack, slots: int):
        self.host = (gate, up, down)
        self.experts = len(gate.experts)
        if not 0 <= slots <= self.experts:
            raise ValueError(f"a layer has {self.experts} experts; cannot hold {slots} slots")
        self.slot_of = torch.full((self.experts,), -1, dtype=torch.int32)
        self.expert_at = [-1] * slots
        self.buffers: list[tuple[torch.Tensor, ...]] = []
        self.linears: list[tuple[Linear, ...]] = []
        for _ in range(slots):
            bufs = tuple(torch.empty_like(storage_of(stack.experts[0])) for stack in self.host)
            self.buffers.append(bufs)
            self.linears.append(tuple(linear_over(stack.experts[0], b) for stack, b in zip(self.host, bufs, strict=True)))

    @property
    def size(self) -> int:
        return len(self.expert_at)

    def nbytes(self) -> int:
        """Bytes the slots' buffers take."""
        return sum(b.numel() * b.element_size() for bufs in self.buffers for b in bufs)

    def cached(self) -> int:
        return sum(e >= 0 for e in self.expert_at)

    def evict(self, slot: int) -> None:
        old = self.expert_at[slot]
        if old >= 0:
            self.slot_of[old] = -1
            self.expert_at[slot] = -1

    def fill(self, slot: int, expert: int) -> None:
        if self.slot_of[expert] >= 0:
            raise ValueError(f"expert {expert} is already cached in slot {int(self.slot_of[expert])}")
        for buf, stack in zip(self.buffers[slot], self.host, strict=True):
            buf.copy_(storage_of(stack.experts[expert]))

    def publish(self, slot: int, expert: int) -> None:
        self.expert_at[slot] = expert
        self.slot_of[expert] = slot

    def load(self, slot: int, expert: int) -> None:
        """The three steps at once (blocking)."""
        self.evict(slot)
        self.fill(slot, expert)
        self.publish(slot, expert)

    def run_cached(self, slot: int, x: torch.Tensor) -> torch.Tensor:
        return swiglu(*self.linears[slot], x)

    def run_host(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = self.host
        return swiglu(gate.experts[expert], up.experts[expert], down.experts[expert], x)
