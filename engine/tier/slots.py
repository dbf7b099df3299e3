"""One layer's expert cache: N slots, each a copy of one expert's three matrices, and the slot table.

`slot_of` (int32 `[experts]` on the host, the slot holding each expert or -1) is the table a fused MoE
kernel reads (the GPU tier copies it to the device per window); `expert_at[s]` is its inverse (-1: the
slot is empty). A swap is three steps so that a copy can run elsewhere (a CUDA stream) while the layer
keeps serving: `evict` (the table forgets the slot's expert: its entries become misses at once),
`fill` (the copy into the slot's buffers), `publish` (the table points the new expert at the slot).

`SlotTable` is the table and its steps; `LayerSlots` (the simulated tier) keeps its slots in host
buffers and fills them with a plain copy; `engine.tier.gpu_slots.GpuLayerSlots` keeps them in VRAM.
"""

from __future__ import annotations

import torch

from engine.experts import swiglu
from engine.tier.slot_linear import linear_over, storage_of
from engine.weights import Linear, LinearStack


class SlotTable:
    def __init__(self, experts: int, slots: int):
        if not 0 <= slots <= experts:
            raise ValueError(f"a layer has {experts} experts; cannot hold {slots} slots")
        self.experts = experts
        self.slot_of = torch.full((experts,), -1, dtype=torch.int32)
        self.expert_at = [-1] * slots
        self.version = 0  # bumped whenever the table changes (a device copy of it knows when it is stale)

    @property
    def size(self) -> int:
        return len(self.expert_at)

    def cached(self) -> int:
        return sum(e >= 0 for e in self.expert_at)

    def nbytes(self) -> int:
        """Bytes the slots' buffers take."""
        raise NotImplementedError

    def evict(self, slot: int) -> None:
        old = self.expert_at[slot]
        if old >= 0:
            self.slot_of[old] = -1
            self.expert_at[slot] = -1
            self.version += 1

    def fill(self, slot: int, expert: int) -> None:
        raise NotImplementedError

    def publish(self, slot: int, expert: int) -> None:
        self.expert_at[slot] = expert
        self.slot_of[expert] = slot
        self.version += 1

    def load(self, slot: int, expert: int) -> None:
        """The three steps at once."""
        self.evict(slot)
        if self.slot_of[expert] >= 0:
            raise ValueError(f"expert {expert} is already cached in slot {int(self.slot_of[expert])}")
        self.fill(slot, expert)
        self.publish(slot, expert)


class LayerSlots(SlotTable):
    """The simulated tier's slots: host buffers in the host matrices' format, run by the CPU kernels."""

    def __init__(self, gate: LinearStack, up: LinearStack, down: LinearStack, slots: int):
        super().__init__(len(gate.experts), slots)
        self.host = (gate, up, down)
        self.buffers: list[tuple[torch.Tensor, ...]] = []
        self.linears: list[tuple[Linear, ...]] = []
        for _ in range(slots):
            bufs = tuple(torch.empty_like(storage_of(stack.experts[0])) for stack in self.host)
            self.buffers.append(bufs)
            self.linears.append(tuple(linear_over(stack.experts[0], b) for stack, b in zip(self.host, bufs, strict=True)))

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for bufs in self.buffers for b in bufs)

    def fill(self, slot: int, expert: int) -> None:
        for buf, stack in zip(self.buffers[slot], self.host, strict=True):
            buf.copy_(storage_of(stack.experts[expert]))

    def run_cached(self, slot: int, x: torch.Tensor) -> torch.Tensor:
        return swiglu(*self.linears[slot], x)

    def run_host(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = self.host
        return swiglu(gate.experts[expert], up.experts[expert], down.experts[expert], x)
