"""`GpuTieredExperts`: one layer's routed experts on a GPU with a VRAM cache, behind `Experts`.

Per call (a decode window or a prompt chunk) the routing comes back to the host once: that read is
what decides who computes each routed expert.
- cached experts: the fused MoE kernel over the layer's VRAM slots (`GpuLayerSlots`);
- misses: a `pcie_frac` share of them (the most routed first; every miss of a prompt chunk, which
  streams experts) cross PCIe: copied whole into VRAM (`Staging`, DMA at the link's speed) and read
  there by the same kernel, or without staging read by the kernel in place in pinned host memory
  (small scattered reads: a fraction of the link's speed); the rest run on the CPU
  with the CPU kernels over the same host blocks, while the GPU works on the others (its kernels are
  queued before the CPU starts). Their outputs are copied up and patched in before the rows combine.

A pair computed by the kernel gives the same bits from a slot or over PCIe; the CPU rounds differently.
So with `pcie_frac` 0 or 1 and a fixed cache a row's result depends on its own routing only.
"""

from __future__ import annotations

import time

import torch

from engine.experts import Experts, ExpertStats, combine, swiglu
from engine.kernels import triton_moe
from engine.kernels.triton_blocks import MATVEC_ROWS
from engine.tier.gpu_slots import GpuLayerSlots, Staging


class GpuTieredExperts(Experts):
    def __init__(self, slots: GpuLayerSlots, pcie_frac: float = 0.0, streams: bool = True,
                 staging: Staging | None = None):
        self.slots = slots
        self.staging = staging  # where prompt chunks copy their misses (None: the kernel reads host memory)
        self.pcie_frac = pcie_frac  # share of a decode window's missed experts read over PCIe
        self.streams = streams  # prompt chunks read their misses over PCIe (else on the CPU)
        self.routed = torch.zeros(slots.experts, dtype=torch.int64)  # entries per expert, every call (the profile)
        self.table = torch.empty(slots.experts, dtype=torch.int32, device=slots.device)  # this call's slot table
        self._stats = ExpertStats()

    def split_misses(self, missing: list[int], counts: torch.Tensor, rows: int) -> tuple[list[int], list[int]]:
        """(read over PCIe, run on the CPU): a prompt chunk streams all its misses; a decode window sends
        the `pcie_frac` share of them with the most entries over PCIe."""
        if rows > MATVEC_ROWS and self.streams:
            return missing, []
        by_count = sorted(missing, key=lambda e: (-int(counts[e]), e))
        far = round(self.pcie_frac * len(by_count))
        return by_count[:far], by_count[far:]

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        n, k = ids.shape
        ids_host = ids.cpu()  # the layer's one host sync: it decides who computes each expert
        counts = torch.bincount(ids_host.reshape(-1), minlength=self.slots.experts)
        self.routed += counts
        table = self.slots.slot_of.clone()
        routed = counts.nonzero().flatten().tolist()
        far, on_cpu = self.split_misses([e for e in routed if table[e] < 0], counts, n)
        for e in far:
            table[e] = triton_moe.far_slot(e)
        # read before the GPU work is queued: a read after it would wait for it
        x_host = x.float().cpu() if on_cpu else None
        self.table.copy_(table)
        if far and self.staging is not None:
            gate, up, down = self.staging.stage(self.slots, far)
        else:
            gate, up, down = self.slots.stacks
        routing = triton_moe.Routing.of(ids, self.slots.experts, None if n <= MATVEC_ROWS else gate.gemm_m)
        h = triton_moe.swiglu(gate, up, x.contiguous(), routing, self.table)
        y = triton_moe.project(down, h, routing, self.table)
        patch, cpu_us = (self._on_cpu(x_host, ids_host, on_cpu) if x_host is not None else (None, 0))
        far_n, cpu_n = (int(counts[part].sum()) if part else 0 for part in (far, on_cpu))
        s = self._stats
        s.lookups += n * k
        s.vram += n * k - far_n - cpu_n
        s.pcie += far_n
        s.cpu += cpu_n
        s.cpu_us += cpu_us
        return combine(y, routing.order, weights, patch)

    def _on_cpu(self, x: torch.Tensor, ids: torch.Tensor, experts: list[int]
                ) -> tuple[tuple[torch.Tensor, torch.Tensor], int]:
        """The pairs of `experts` computed on the CPU: (their flat pair indices, outputs) on the GPU, and
        the microseconds the CPU spent."""
        t0 = time.perf_counter()
        gate, up, down = self.slots.host
        flat = ids.reshape(-1)
        k = ids.shape[1]
        pairs, outputs = [], []
        for e in experts:
            idx = (flat == e).nonzero().flatten()
            pairs.append(idx)
            outputs.append(swiglu(gate.experts[e], up.experts[e], down.experts[e], x[idx // k]))
        idx, out = torch.cat(pairs), torch.cat(outputs)
        spent = round((time.perf_counter() - t0) * 1e6)
        device = self.slots.device
        return (idx.to(device), out.to(device)), spent


def measure_pcie_frac(layer: GpuTieredExperts, reps: int = 5) -> tuple[float, str]:
    """`--pcie-frac -1`: the share of a decode window's misses to read over PCIe so that the GPU and the CPU
    finish together, from one row's time with all its experts read over PCIe against all on the CPU
    (timed on `layer`, whose slots must be empty). Returns (share, how it was chosen)."""
    device = layer.slots.device
    k = min(8, layer.slots.experts)
    hidden = layer.slots.host[0].experts[0].in_features
    x = torch.zeros(1, hidden, dtype=torch.bfloat16, device=device)
    weights = torch.full((1, k), 1 / k, device=device)
    ids = torch.arange(k, device=device).view(1, k)
    seconds = {}
    try:
        for frac in (1.0, 0.0):
            layer.pcie_frac = frac
            layer(x, weights, ids)  # compiles the kernels, warms the CPU pool
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            for _ in range(reps):
                layer(x, weights, ids)
            torch.cuda.synchronize(device)
            seconds[frac] = (time.perf_counter() - t0) / reps
    except RuntimeError as exc:  # the kernel cannot read host memory on this system
        return 0.0, f"misses on the CPU (the GPU cannot read host memory here: {exc})"
    finally:
        layer.routed.zero_()
        layer._stats = ExpertStats()
    far, cpu = seconds[1.0], seconds[0.0]
    share = round(cpu / (far + cpu), 2)
    return share, (f"{k} experts of one row: {far * 1e6:.0f} us over PCIe, {cpu * 1e6:.0f} us on the CPU "
                   f"-> {share:.0%} of misses over PCIe")
