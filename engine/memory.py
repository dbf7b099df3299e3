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


def memory_split(model, n_slots: int) -> list[dict]:
    kv = model.kv
    per_session = sum(t[0].numel() * t.element_size() for t in kv.k + kv.v)
    free, total = free_bytes(model.device)
    name = str(model.device) if model.device.type == "cpu" else f"cuda:{model.device.index or 0}"
    here = str(model.device)
    cache = model.tier.cache_bytes() if model.tier is not None and model.tier.mode == "gpu" else 0
    return [{
        "device": name,
        "total_mib": total // MIB,
        "weights_mib": (model.w.split().get(here, 0) + cache) // MIB,
        "experts_mib": (model.w.split(lambda n: "_exps" in n).get(here, 0) + cache) // MIB,
        "slots_mib": per_session * n_slots // MIB,
        "kv_mib": per_session // MIB,
        "free_mib": free // MIB,
    }]
