"""`TieredExperts`: one layer's routed experts served from its cache slots when cached, from the
host copies (the file's format in host RAM) when not, behind the `Experts` interface.

On the simulated tier (no GPU) both run on the CPU with the same kernels over the same bytes, so a
cached expert gives bit for bit what its host copy gives; the entries are counted as they would be
on a GPU: cached ones as `vram`, misses as `cpu` (with the time spent on them). Rows are combined
in a fixed order (`combine`), so a row's result depends on its own routing only.
"""

from __future__ import annotations

import time

import torch

from engine.experts import Experts, ExpertStats, by_expert, combine
from engine.tier.slots import LayerSlots


class TieredExperts(Experts):
    def __init__(self, slots: LayerSlots):
        self.slots = slots
        self.routed = torch.zeros(slots.experts, dtype=torch.int64)  # entries per expert, every call (the profile)
        self._stats = ExpertStats()

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        n, k = ids.shape
        flat, order = by_expert(ids)
        xs = x[order // k]
        experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
        self.routed.index_add_(0, experts, counts)
        y = torch.empty_like(xs)
        slot_of = self.slots.slot_of.tolist()
        hits = misses = 0
        miss_s = 0.0
        start = 0
        for expert, count in zip(experts.tolist(), counts.tolist(), strict=True):
            part = xs[start : start + count]
            slot = slot_of[expert]
            if slot >= 0:
                y[start : start + count] = self.slots.run_cached(slot, part)
                hits += count
            else:
                t0 = time.perf_counter()
                y[start : start + count] = self.slots.run_host(expert, part)
                miss_s += time.perf_counter() - t0
                misses += count
            start += count
        s = self._stats
        s.lookups += n * k
        s.vram += hits
        s.cpu += misses
        s.cpu_us += round(miss_s * 1e6)
        return combine(y, weights, order, residual=residual)
