"""`BlockExperts`: a layer's SwiGLU experts kept in the file's blocks on a CUDA device and run by the fused
MoE kernel (`engine.kernels.triton_moe`): two launches a window (gate and up with their SwiGLU, then
down), every routed expert's blocks read once per window, expert ids looked up through `slot_of`.
Prompt chunks of `DEQUANTIZED_ROWS` rows or more in bf16 take every expert dequantized to bf16 first, one stack
at a time, and torch's grouped GEMMs, where those run. This module imports Triton;
`engine.experts.resident_experts` imports it only when a store kept the stacks' blocks."""

from __future__ import annotations

import torch

from engine.experts import Experts, ExpertStats, by_expert, combine, grouped_mm_runs, grouped_swiglu
from engine.kernels import triton_moe
from engine.weights import LinearStack

# A prompt chunk's rows from which its experts are dequantized first: each expert's weights become bf16 once a
# chunk, where the fused GEMM's tiles dequantize them again for every tile of pairs, and the grouped GEMMs keep
# the tensor cores busier; a stack's bf16 copy (~400 MB at qwen3-30b-a3b's shapes) is alive at the chunk's peak,
# which `--prefill auto` measures. H100, 128 experts, Q4_K gate+up and Q6_K down, skewed routing, fused ->
# dequantized + grouped: 512 rows 1,093 -> 1,188 us (slower), 2,160 rows 2,633 -> 1,376, 4,096 rows 4,403 -> 1,577
DEQUANTIZED_ROWS = 1024


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
        self.dequantizes = self.on_gpu and grouped_mm_runs(device)  # prompt chunks of DEQUANTIZED_ROWS or more
        self._stats = ExpertStats()

    def replayable(self, rows: int) -> bool:
        return self.on_gpu

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        n, k = ids.shape
        self._stats.lookups += n * k
        if self.on_gpu:
            self._stats.vram += n * k
        else:  # Triton's interpreter (tests)
            self._stats.cpu += n * k
        if self.dequantizes and n >= DEQUANTIZED_ROWS and x.dtype == torch.bfloat16:  # the grouped GEMMs' type
            return self._dequantized(x, weights, ids, residual)
        y, routing = triton_moe.swiglu_experts(self.gate, self.up, self.down, x, ids, self.slot_of)
        return combine(y, weights, residual=residual)

    def _dequantized(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                     residual: torch.Tensor | None) -> torch.Tensor:
        """The chunk's pairs sorted by expert through grouped GEMMs over each stack dequantized in turn (one
        stack's bf16 copy alive at a time)."""
        flat, order = by_expert(ids)
        y = grouped_swiglu(x[order // ids.shape[1]], flat, self.n_experts, self.gate.dequantize, self.up.dequantize,
                           self.down.dequantize)
        return combine(y, weights, order, residual=residual)
