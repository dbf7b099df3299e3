"""`GpuBlockLinear`: a matrix kept in the file's blocks on a CUDA device, multiplied by the Triton
kernels of `engine.kernels.triton_blocks` (this module imports Triton; `engine.weights` imports it only
once a CUDA store keeps blocks)."""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as Q

from engine.kernels import triton_blocks
from engine.kernels.gpu import MATVEC_ROWS
from engine.kernels.triton_tiles import HALF_DTYPES, BlockTiles
from engine.kernels.triton_unpacked import Unpacked
from engine.weights import Linear

# Rows of x from which the matrix is dequantized to x's dtype first and multiplied by torch (cuBLAS), where
# its dequantized copy takes at most DEQUANTIZED_BYTES (not a head's): the dequantize-in-tile GEMM dequantizes
# each tile of weights again for every tile of rows. H100, bf16, tile GEMM -> dequantized + torch.mm: Q4_K
# 5,120 x 2,048 at 64 / 512 / 2,160 rows 40.4 -> 16.8 / 134.1 -> 28.5 / 523.2 -> 80.7 us, Q6_K 42.1 -> 20.9 /
# 141.9 -> 32.5 / 567.2 -> 85.7 us
DEQUANTIZED_ROWS = 64
DEQUANTIZED_BYTES = 256 * 2**20


class GpuBlockLinear(Linear):
    """The file's blocks `[out_features, row_bytes]` on `device`: the matvec for up to
    `triton_blocks.MATVEC_ROWS` rows (decode windows), the dequantize-in-tile GEMM above (prompt
    chunks), from `DEQUANTIZED_ROWS` rows the matrix dequantized and torch's product (where its copy is
    small enough); products in x's dtype, accumulated in float32. With a dense copy kept
    (`engine.dense_copies`), every product of two rows or more is torch's on the copy; with tiles kept instead
    (`keep_tiles`), windows of 2-8 rows in bf16/f16 take them, and from 9 rows the matrix is dequantized as above."""

    def __init__(self, qtype: Q, blocks: torch.Tensor, in_features: int, device: torch.device):
        self.matrix = triton_blocks.Matrix(qtype, blocks.to(device), in_features)
        self.out_features = blocks.shape[0]
        self.in_features = in_features
        self.nbytes = blocks.numel()
        self.copy: torch.Tensor | None = None
        self.tiles: BlockTiles | Unpacked | None = None

    def keep_copy(self, dtype: torch.dtype) -> int:
        """Keep the matrix dequantized to `dtype` beside its blocks; the copy's bytes."""
        self.copy = self.matrix.dequantize(dtype=dtype)
        return self.copy.numel() * self.copy.element_size()

    def keep_tiles(self) -> int:
        """Take windows of 2-8 rows in bf16/f16 on tiles dequantized in registers: a Q4_K matrix's own blocks
        (`triton_tiles.BlockTiles`), a Q6_K one's values unpacked beside them (`triton_unpacked`); the bytes kept
        beside the blocks."""
        m = self.matrix
        if m.qtype == Q.Q4_K:
            self.tiles = BlockTiles(m.qtype, m.blocks, m.k)  # `TileLaunch`'s own until a sweep picks per shape
            return 0
        if m.qtype == Q.Q6_K:
            self.tiles = Unpacked(m.blocks, m.k)
            return self.tiles.nbytes
        raise ValueError(f"{m.qtype.name} has no tiles (Q4_K and Q6_K do)")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        m = rows.shape[0]
        # with tiles, 9-63 rows are dequantized too: the dequantize-in-tile GEMM is the slower (64 rows, above)
        dequantized_from = MATVEC_ROWS + 1 if self.tiles is not None else DEQUANTIZED_ROWS
        if self.tiles is not None and 1 < m <= MATVEC_ROWS and rows.dtype in HALF_DTYPES:
            y = self.tiles.matvec(rows.contiguous())
        elif self.copy is not None and m > 1 and rows.dtype == self.copy.dtype:
            y = torch.mm(rows, self.copy.t())
        elif (m >= dequantized_from
                and self.out_features * self.in_features * rows.element_size() <= DEQUANTIZED_BYTES):
            y = torch.mm(rows, self.matrix.dequantize(dtype=rows.dtype).t())
        else:
            y = self.matrix.matmul(rows.contiguous())
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
