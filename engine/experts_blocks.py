"""`BlockExperts`: a layer's SwiGLU experts kept in the file's blocks on a CUDA device and run by the fused
MoE kernel (`engine.kernels.triton_moe`): two launches a window (gate and up with their SwiGLU, then
down), every routed expert's blocks read once per window, expert ids looked up through `slot_of`.
This module imports Triton; `engine.experts.resident_experts` imports it only when a store kept the
stacks' blocks."""

from __future__ import annotations

import torch

from engine.experts import Experts, ExpertStats, combine
from engine.kernels import triton_moe
from engine.weights import LinearStack


def _stack(s: LinearStack, k: int, tiles: triton_moe.Tiles | None) -> triton_moe.Stack:
    if s.blocks is None or s.qtype is None:
        raise ValueError("BlockExperts needs stacks kept in their blocks (LinearStack.blocks and qtype)")
    return triton_moe.Stack(s.qtype, s.blocks, k, tiles)


class BlockExperts(Experts):
    """SwiGLU experts, gate/up `[E, F, H]` and down `[E, H, F]` in their blocks on `device`. `slot_of`
    (int32 `[E]` on the device) maps an expert id to its index in the stacks: the identity here; an
    expert tier may hold a cache of slots in the stacks and point the table at them."""

    def __init__(self, gate: LinearStack, up: LinearStack, down: LinearStack, device: torch.device,
                 tiles: triton_moe.Tiles | None = None):
        self.gate = _stack(gate, gate.experts[0].in_features, tiles)
        self.up = _stack(up, up.experts[0].in_features, tiles)
        self.down = _stack(down, down.experts[0].in_features, tiles)
        if self.down.gemm_m != self.gate.gemm_m:
            raise ValueError(f"gate and down GEMM tiles differ ({self.gate.gemm_m}, {self.down.gemm_m} pairs)")
        self.n_experts = self.gate.slots
        self.slot_of = torch.arange(self.n_experts, dtype=torch.int32, device=device)
        self.on_gpu = device.type == "cuda"
        self._stats = ExpertStats()

    def replayable(self, rows: int) -> bool:
        return self.on_gpu

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        n, k = ids.shape
        y, routing = triton_moe.swiglu_experts(self.gate, self.up, self.down, x, ids, self.slot_of)
        self._stats.lookups += n * k
        if self.on_gpu:
            self._stats.vram += n * k
        else:  # Triton's interpreter (tests)
            self._stats.cpu += n * k
        return combine(y, weights, residual=residual)
