"""`GpuLayerSlots`: one layer's expert cache in VRAM for the fused MoE kernel.

Each projection's slots are one uint8 stack `[slots, n, row_bytes]` on the device, in the file's
blocks, and the layer's host stack (pinned) is the kernel's `far` tensor: an expert the table marks
`far_slot(e)` is read from host memory over PCIe in place. `fill` copies an expert's blocks from the
pinned host stack into its slot on the current CUDA stream, so the copy is ordered before the next
window's kernels and the host never waits for it.
"""

from __future__ import annotations

import torch

from engine.kernels import triton_moe
from engine.tier.slots import SlotTable
from engine.weights import LinearStack


def host_blocks(stack: LinearStack) -> torch.Tensor:
    """The stack's blocks in host memory (as `WeightStore(host_experts=True)` keeps them)."""
    if stack.blocks is None or stack.qtype is None or stack.blocks.device.type != "cpu":
        raise ValueError("the GPU expert tier needs the expert stacks in host memory in their blocks "
                         "(a type the CPU and GPU kernels both read)")
    return stack.blocks


class GpuLayerSlots(SlotTable):
    def __init__(self, gate: LinearStack, up: LinearStack, down: LinearStack, slots: int, device: torch.device,
                 tiles: triton_moe.Tiles | None = None, buffers: tuple[torch.Tensor, ...] | None = None):
        super().__init__(host_blocks(gate).shape[0], slots)
        self.host = (gate, up, down)
        self.device = device
        # `buffers`: views of `buffer_shapes` (a device's `loan.SlotArena`), else allocated here
        self.buffers = buffers or tuple(torch.empty(shape, dtype=torch.uint8, device=device)
                                        for shape in self.buffer_shapes(self.host, slots))
        self.stacks = tuple(triton_moe.Stack(s.qtype, buf, s.experts[0].in_features, tiles, far=host_blocks(s))
                            for s, buf in zip(self.host, self.buffers, strict=True))

    @staticmethod
    def buffer_shapes(host: tuple[LinearStack, ...], slots: int) -> list[tuple[int, ...]]:
        """Each projection's slots, uint8 `[slots, n, row_bytes]`: at least one (the kernel takes a stack's
        pointer even when the table never points at it)."""
        return [(max(slots, 1), *host_blocks(s).shape[1:]) for s in host]

    def nbytes(self) -> int:
        return self.size * sum(b[0].numel() for b in self.buffers)

    def fill(self, slot: int, expert: int, projections: tuple[int, ...] = (0, 1, 2)) -> None:
        for p in projections:
            self.buffers[p][slot].copy_(self.host[p].blocks[expert], non_blocking=True)


class Staging:
    """VRAM the misses that cross PCIe are copied into before the kernel reads them: whole experts, by DMA
    or by the GPU's own copy kernel (`triton_moe.stage_far`), at the link's speed, where the matvec's own
    reads of host memory reach less than half of it (they are small and scattered). `entries` experts a
    projection, one after another (`staging_entries`: a decode window's pairs at most; a prompt chunk with
    more misses takes several passes), each as large as the largest layer's; the layers use it in turn,
    their copies and kernels ordered on one stream."""

    def __init__(self, layers: list[GpuLayerSlots], entries: int):
        device = layers[0].device
        self.entries = entries
        self.buffers = [torch.empty(entries * max(layer.host[p].blocks[0].numel() for layer in layers),
                                    dtype=torch.uint8, device=device) for p in range(3)]

    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def stacks(self, slots: GpuLayerSlots) -> tuple[triton_moe.Stack, ...]:
        """The layer's stacks reading their far entries in the buffers (`entries` of them, in its shapes)."""
        out = []
        for buf, host, stack in zip(self.buffers, slots.host, slots.stacks, strict=True):
            shape = (self.entries, *host.blocks.shape[1:])
            out.append(stack.with_far(buf[: shape[0] * host.blocks[0].numel()].view(shape)))
        return tuple(out)
