"""Dense copies: VRAM left free turned into faster batches (`--dense-copies`, off until timed on a GPU).

A decode window of 2-8 rows multiplies each layer's dense matrices (attention's q|k|v and output) with the
tensor-core kernels over the file's blocks (`triton_blocks._mma_kernel`). At these shapes they are bound by
latency, not bandwidth: on an H100, Q4_K 5,120 x 2,048 at 8 rows takes 17.6 us for its 5.9 MB (~12% of the
bandwidth). The same matrix dequantized to bf16 is a plain product for cuBLAS: at 64 rows 16.8 us, 9.0 of them
dequantizing it (`linear_gpu.DEQUANTIZED_ROWS`), for a copy 3.6x the blocks' bytes. So where VRAM is left after the weights, the slots, the expert cache and the prompt chunk's peak,
each layer's matrices of at most `MAX_COPY_BYTES` keep such a copy (`GpuBlockLinear.keep_copy`), in layer order
while they fit, and every product of 2 rows or more takes it; one row keeps the blocks (the int16 kernel reads
fewer bytes). Larger matrices (a head: 594 MiB as bf16) keep only their blocks.

Exact mode keeps no copies: torch's products choose their kernels by the number of rows, so a row's bits would
depend on what it is read with.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from engine.loading import RESERVE
from engine.memory import MIB, device_key, free_bytes
from engine.models.base import Model
from engine.weights import Linear, Projections

MAX_COPY_BYTES = 64 * MIB  # qwen3-30b-a3b's q|k|v copy: 20 MiB, its attn_output's: 16 MiB; a head's: 594 MiB


@dataclass
class DenseCopies:
    """What `keep_dense_copies` kept: how many matrices, and their bytes per device (`memory.device_key`)."""

    matrices: int = 0
    bytes: dict[str, int] = field(default_factory=dict)

    def describe(self) -> str:
        if not self.matrices:
            return "none (no VRAM left for them)"
        return f"{self.matrices} matrices, " + ", ".join(f"{n / MIB:.0f} MiB on {d}" for d, n in self.bytes.items())


def layer_matrices(model: Model) -> Iterator[Linear]:
    """The layers' matrices kept in blocks on a GPU (`GpuBlockLinear`), in layer order (a joined q|k|v as one;
    expert stacks not)."""
    from engine.linear_gpu import GpuBlockLinear  # imports Triton: only where a GPU runs the model

    for block in model.blk:
        for part in vars(block).values():
            matrices = [m for m, _ in part.runs] if isinstance(part, Projections) else [part]
            yield from (m for m in matrices if isinstance(m, GpuBlockLinear))


def keep_dense_copies(model: Model, reserve: int = RESERVE) -> DenseCopies:
    """Give the layers' matrices of at most `MAX_COPY_BYTES` a copy in the model's dtype, in layer order, each where
    it still fits in the VRAM free on its device (measured before the first copy there) beyond `reserve`."""
    kept = DenseCopies()
    left: dict[str, int] = {}
    size = model.dtype.itemsize
    for matrix in layer_matrices(model):
        need = matrix.out_features * matrix.in_features * size
        device = matrix.matrix.blocks.device
        key = device_key(device)
        if key not in left:
            left[key] = free_bytes(device)[0] - reserve
        if need > MAX_COPY_BYTES or need > left[key]:
            continue
        try:
            matrix.keep_copy(model.dtype)
        except torch.cuda.OutOfMemoryError:  # the allocator's blocks round up: what is kept stays
            break
        left[key] -= need
        kept.matrices += 1
        kept.bytes[key] = kept.bytes.get(key, 0) + need
    return kept


def add_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dense-copies", choices=("on", "off"), default="off",
                   help="GPU: the layers' dense matrices dequantized once into the VRAM left free, for windows of 2-8 "
                        "rows and prompt chunks (cuBLAS's products instead of the blocks' kernels; not yet timed on a "
                        "GPU; none in exact mode)")


def install(model: Model, asked: str, exact: bool) -> str | None:
    """`--dense-copies` on a model loaded and sized (slots, expert cache, prompt chunk): the log line; None where
    off or where no GPU runs the model."""
    if asked != "on" or not model.placement.on_gpu():
        return None
    if exact:
        return "dense copies: none in exact mode (torch's products choose their kernels by the number of rows)"
    kept = keep_dense_copies(model)
    model.copy_bytes = kept.bytes
    return f"dense copies for windows of 2-8 rows: {kept.describe()}"
