"""`GpuBlockLinear`: a matrix kept in the file's blocks on a CUDA device, multiplied by the Triton
kernels of `engine.kernels.triton_blocks` (this module imports Triton; `engine.weights` imports it only
once a CUDA store keeps blocks)."""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as Q

from engine.kernels import triton_blocks
from engine.weights import Linear


class GpuBlockLinear(Linear):
    """The file's blocks `[out_features, row_bytes]` on `device`: the matvec for up to
    `triton_blocks.MATVEC_ROWS` rows (decode windows), the dequantize-in-tile GEMM above (prompt
    chunks); products in x's dtype, accumulated in float32."""

    def __init__(self, qtype: Q, blocks: torch.Tensor, in_features: int, device: torch.device):
        self.matrix = triton_blocks.Matrix(qtype, blocks.to(device), in_features)
        self.out_features = blocks.shape[0]
        self.in_features = in_features
        self.nbytes = blocks.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matrix.matmul(x.reshape(-1, self.in_features).contiguous())
        return y.reshape(*x.shape[:-1], self.out_features)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return self.matrix.dequantize(ids.reshape(-1))

    def kind(self) -> tuple:
        return "gpu blocks", self.matrix.qtype, self.in_features, self.matrix.blocks.device

    @classmethod
    def joined(cls, parts: list[Linear]) -> Linear:
        first = parts[0]
        return cls(first.matrix.qtype, torch.cat([p.matrix.blocks for p in parts]), first.in_features,
                   first.matrix.blocks.device)
