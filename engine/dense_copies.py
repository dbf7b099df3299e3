"""Dense copies: VRAM left free turned into faster batches (`--dense-copies`, on by default).

A decode window of 2-8 rows multiplies each layer's dense matrices (attention's q|k|v and output) with the
tensor-core kernels over the file's blocks (`triton_blocks._mma_kernel`). At these shapes they are bound by
latency, not bandwidth: on an H100, Q4_K 5,120 x 2,048 at 8 rows takes 16.6 us for its 5.6 MiB. The same matrix
dequantized to bf16 is a plain product for cuBLAS: 5.6 us (`python -m engine.kernels.sweep --copies`), for a copy
3.6x the blocks' bytes. So where VRAM is left after the weights, the slots, the expert cache and the prompt chunk's
peak, each layer's matrices of at most `MAX_COPY_BYTES` keep such a copy (`GpuBlockLinear.keep_copy`), in layer
order while they fit, then the head where its type gains enough (`HEAD_COPY_TYPES`); every product of 2 rows or
more takes it, and one row keeps the blocks (the int16 kernel reads fewer bytes: 6.4 against 6.7 us, the Q6_K head
133.5 against 205.6). Larger layer matrices (a dense model's FFN) keep only their blocks: unmeasured, and the more
a product is bound by bandwidth the less a copy of 2-4x the bytes can gain.

Exact mode keeps no copies: torch's products choose their kernels by the number of rows, so a row's bits would
depend on what it is read with.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from gguf import GGMLQuantizationType as Q

from engine.loading import RESERVE
from engine.memory import MIB, device_key, free_bytes
from engine.models.base import Model
from engine.weights import Linear, Projections

MAX_COPY_BYTES = 64 * MIB  # a layer's matrices: qwen3-30b-a3b's q|k|v copy 20 MiB, its attn_output's 16 MiB
# heads that get a copy too, after the layers' (which save more time per byte). H100, 8 rows, 151,936 x 2,048: Q6_K
# 288.9 -> 208.3 us for 594 MiB; Q8_0 only 220.4 -> 208.2, so it keeps its blocks
HEAD_COPY_TYPES = (Q.Q6_K,)
# with `--dense-tiles on` (off until timed faster on a GPU) and the model's dtype bf16 or f16, these types' matrices
# take tiles dequantized in registers instead of a copy (`GpuBlockLinear.keep_tiles`): a layer's Q4_K matrices their
# own blocks, a Q6_K head its values unpacked
LAYER_TILE_TYPES = (Q.Q4_K,)
HEAD_TILE_TYPES = (Q.Q6_K,)


@dataclass
class DenseCopies:
    """What `keep_dense_copies` kept: how many matrices, and their bytes per device (`memory.device_key`)."""

    matrices: int = 0
    tiles: int = 0  # of them on tiles (`GpuBlockLinear.keep_tiles`) rather than a copy
    bytes: dict[str, int] = field(default_factory=dict)

    def describe(self) -> str:
        if not self.matrices:
            return "none (no VRAM left for them)"
        tiles = f" ({self.tiles} on tiles)" if self.tiles else ""
        where = ", ".join(f"{n / MIB:.0f} MiB on {d}" for d, n in self.bytes.items())
        return f"{self.matrices} matrices{tiles}, {where}"


def layer_matrices(model: Model) -> Iterator[Linear]:
    """The layers' matrices kept in blocks on a GPU (`GpuBlockLinear`), in layer order (a joined q|k|v as one;
    expert stacks not)."""
    from engine.linear_gpu import GpuBlockLinear  # imports Triton: only where a GPU runs the model

    for block in model.blk:
        for part in vars(block).values():
            matrices = [m for m, _ in part.runs] if isinstance(part, Projections) else [part]
            yield from (m for m in matrices if isinstance(m, GpuBlockLinear))


def copy_bytes(matrix: Linear, model: Model) -> int:
    """The bytes of `matrix`'s copy in the model's dtype."""
    return matrix.out_features * matrix.in_features * model.dtype.itemsize


def takes_tiles(matrix: Linear, model: Model, tiles: bool) -> bool:
    """Whether `matrix` takes tiles rather than a copy: tiles are asked for, its type is one of `LAYER_TILE_TYPES` (a
    head's: `HEAD_TILE_TYPES`) and the model's dtype is bf16 or f16."""
    from engine.kernels.triton_tiles import HALF_DTYPES

    types = HEAD_TILE_TYPES if matrix is model.output else LAYER_TILE_TYPES
    return tiles and model.dtype in HALF_DTYPES and matrix.matrix.qtype in types


def extra_bytes(matrix: Linear, model: Model, on_tiles: bool) -> int:
    """The VRAM `matrix`'s fast form takes beside its blocks: on tiles (`takes_tiles`), none for a Q4_K matrix, the
    unpacked values for a Q6_K one; else the copy in the model's dtype."""
    from engine.kernels.triton_unpacked import unpacked_bytes

    if not on_tiles:
        return copy_bytes(matrix, model)
    return unpacked_bytes(matrix.out_features, matrix.in_features) if matrix.matrix.qtype == Q.Q6_K else 0


def wanted(model: Model) -> Iterator[Linear]:
    """The matrices that get a copy where it fits, in order: the layers' whose copy (in the model's dtype) takes at
    most `MAX_COPY_BYTES`, layer by layer, then the head where its type is one of `HEAD_COPY_TYPES`."""
    from engine.linear_gpu import GpuBlockLinear

    yield from (m for m in layer_matrices(model) if copy_bytes(m, model) <= MAX_COPY_BYTES)
    head = model.output
    if isinstance(head, GpuBlockLinear) and head.matrix.qtype in HEAD_COPY_TYPES:
        yield head


def keep_dense_copies(model: Model, reserve: int = RESERVE, tiles: bool = False) -> DenseCopies:
    """Give the `wanted` matrices their tiles (where `tiles` and `takes_tiles`) or a copy in the model's dtype, in
    order, each where it still fits in the VRAM free on its device (measured before the first one there) beyond
    `reserve`."""
    kept = DenseCopies()
    left: dict[str, int] = {}
    for matrix in wanted(model):
        on_tiles = takes_tiles(matrix, model, tiles)
        need = extra_bytes(matrix, model, on_tiles)
        device = matrix.matrix.blocks.device
        key = device_key(device)
        if key not in left:
            left[key] = free_bytes(device)[0] - reserve
        if need > left[key]:
            continue
        try:
            matrix.keep_tiles() if on_tiles else matrix.keep_copy(model.dtype)
        except torch.cuda.OutOfMemoryError:  # the allocator's blocks round up: what is kept stays
            break
        left[key] -= need
        kept.matrices += 1
        kept.tiles += on_tiles
        kept.bytes[key] = kept.bytes.get(key, 0) + need
    return kept


def add_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dense-copies", choices=("on", "off"), default="on",
                   help="GPU: the layers' dense matrices and a Q6_K head dequantized once into the VRAM left free, for "
                        "windows of 2-8 rows and prompt chunks (cuBLAS's products instead of the blocks' kernels; none "
                        "in exact mode)")
    p.add_argument("--dense-tiles", choices=("on", "off"), default="off",
                   help="GPU, with --dense-copies on: a bf16/f16 model's Q4_K layer matrices and Q6_K head take "
                        "windows of 2-8 rows on tiles dequantized in registers instead of copies (Q4_K: no VRAM; off "
                        "until timed faster)")


def install(model: Model, asked: str, exact: bool, tiles: str = "off") -> str | None:
    """`--dense-copies` (and `--dense-tiles`) on a model loaded and sized (slots, expert cache, prompt chunk): the log
    line; None where off or where no GPU runs the model."""
    if asked != "on" or not model.placement.on_gpu():
        return None
    if exact:
        return "dense copies: none in exact mode (torch's products choose their kernels by the number of rows)"
    kept = keep_dense_copies(model, tiles=tiles == "on")
    model.copy_bytes = kept.bytes
    return f"dense copies for windows of 2-8 rows: {kept.describe()}"
