"""Where memory goes: the split of each device the engine uses, for INFO and STATS."""

from __future__ import annotations

import psutil
import torch

MIB = 1 << 20


def free_bytes(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of `device`: VRAM for CUDA, available RAM for the CPU."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return free, total
    vm = psutil.virtual_memory()
    return vm.available, vm.total


def device_key(device: torch.device) -> str:
    """How STATS names a device: `cpu`, or `cuda:N` (an unsplit engine's bare `cuda` is `cuda:0`)."""
    return str(device) if device.type == "cpu" else f"cuda:{device.index or 0}"


def memory_split(model, n_slots: int) -> list[dict]:
    """One entry per device the model uses (a layer split: each stage's), with the weights and KV it holds;
    the GPU expert tier's slots count as experts on their layers' device, dense copies as weights."""
    gpu_tier = model.tier is not None and model.tier.mode == "gpu"
    weights, experts = model.w.split(), model.w.split(lambda n: "_exps" in n)
    out = []
    for device in model.placement.devices():
        cache = model.tier.cache_bytes(device) if gpu_tier else 0
        per_session = model.kv.session_bytes(device)
        free, total = free_bytes(device)
        out.append({
            "device": device_key(device),
            "total_mib": total // MIB,
            "weights_mib": (weights.get(str(device), 0) + cache + model.copy_bytes.get(device_key(device), 0)) // MIB,
            "experts_mib": (experts.get(str(device), 0) + cache) // MIB,
            "slots_mib": per_session * n_slots // MIB,
            "kv_mib": per_session // MIB,
            "free_mib": free // MIB,
        })
    return out
