"""How many VRAM cache slots fit: a slot's bytes from the file, `--expert-cache auto` from free VRAM."""

from __future__ import annotations

import torch

from engine.gguf_file import GGUFFile
from engine.kernels.gpu import MATVEC_ROWS
from engine.memory import MIB

PROJECTIONS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
ALIGN = 256  # bytes: where the slot arena's buffers and loans start (`engine.tier.loan`; the kernels want 16)


def slot_bytes(g: GGUFFile, layers: int, experts: int) -> list[int]:
    """Per layer, the bytes of one expert's three matrices in the file's format (one cache slot)."""
    out = []
    for i in range(layers):
        total = 0
        for name in PROJECTIONS:
            info = g.tensors.get(f"blk.{i}.{name}.weight")
            if info is None:
                raise ValueError(f"{g.path}: layer {i} has no {name} tensor: the tier caches SwiGLU expert stacks")
            total += info.nbytes // experts
        out.append(total)
    return out


def staging_entries(experts: int, top_k: int) -> int:
    """Experts the staging buffer holds (`engine.tier.gpu_slots.Staging`): as many as a decode window's
    pairs, so a window never waits for its misses in passes."""
    return min(experts, MATVEC_ROWS * top_k)


def staging_bytes(per_layer: list[int], entries: int) -> int:
    """VRAM the misses that cross PCIe are copied into: `entries` experts of the largest layer."""
    return entries * max(per_layer)


def auto_slots(free: int, reserve_mib: int, per_layer: list[int], experts: int) -> int:
    """`--expert-cache auto` on one device: the slots each of its layers (their slot bytes `per_layer`)
    gets in `free` bytes less the reserve, at most every expert; the same for every layer."""
    usable = max(0, free - reserve_mib * MIB)
    return min(experts, usable // sum(per_layer))  # whole rounds of one slot in every layer


def aligned(n: int) -> int:
    """`n` bytes rounded up to a multiple of ALIGN."""
    return -(-n // ALIGN) * ALIGN


def outputs_bytes(pairs: int, ffn: int, hidden: int, dtype: torch.dtype) -> int:
    """VRAM a prompt chunk's MoE buffers take (`triton_moe.Outputs`): `pairs` SwiGLU rows of `ffn` values
    and as many outputs of `hidden`."""
    return aligned(pairs * ffn * dtype.itemsize) + pairs * hidden * dtype.itemsize


def expert_ffn(g: GGUFFile) -> int:
    """An expert's FFN width: the first routed gate stack's rows."""
    return next(t for name, t in g.tensors.items() if name.endswith(f"{PROJECTIONS[0]}.weight")).shape[1]
