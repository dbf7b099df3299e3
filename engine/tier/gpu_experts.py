"""`GpuTieredExperts`: one layer's routed experts on a GPU with a VRAM cache, behind `Experts`.

A decode window whose misses all cross PCIe (`pcie_frac` 1) never syncs the host: the GPU copies its
missed experts into `Staging` itself (`triton_moe.stage_far`, at the link's speed) and counts the
entries on the device, so the window can be replayed from a CUDA graph. Any other call (a share of
misses on the CPU, a prompt chunk) reads the routing back to the host once: that read decides who
computes each routed expert.
- cached experts: the fused MoE kernel over the layer's VRAM slots (`GpuLayerSlots`);
- misses: a `pcie_frac` share of them (the most routed first; every miss of a prompt chunk, which
  streams experts) cross PCIe: copied whole into VRAM (`Staging`, as many a pass as it holds) and read
  there by the same kernel, or without staging read by the kernel in place in pinned host memory
  (small scattered reads: less than half the link's speed); the rest run on the CPU with the CPU
  kernels over the same host blocks, while the GPU works on the others (its kernels are queued before
  the CPU starts). Their outputs are copied up and patched in before the rows combine.

A pair computed by the kernel gives the same bits from a slot or over PCIe; the CPU rounds differently.
So with `pcie_frac` 0 or 1 and a fixed cache a row's result depends on its own routing only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.experts import Experts, ExpertStats, c_stacks, combine
from engine.kernels import ops as cpu_ops
from engine.kernels import triton_moe
from engine.kernels.triton_blocks import MATVEC_ROWS
from engine.tier.gpu_slots import GpuLayerSlots, Staging
from engine.tier.loan import Lender


class DeviceCounts:
    """The routing counts of one device's tiered layers, all layers in one tensor each, so the tier reads
    them in a few operations a window: the in-place calls count on the device (no host sync), per layer
    the entries per expert then the entries read over PCIe, read back in one copy when the host asks
    after a call; the calls that read the routing back count on the host (`on_host`)."""

    def __init__(self, layers: int, experts: int, device: torch.device):
        self.on_device = torch.zeros(layers, experts + 1, dtype=torch.int64, device=device)
        self.on_host = torch.zeros(layers, experts, dtype=torch.int64)
        self._copied: torch.Tensor | None = None

    @property
    def layers(self) -> int:
        return self.on_host.shape[0]

    def layer(self, index: int) -> torch.Tensor:
        """Layer `index`'s device counts, for a call to count into."""
        self._copied = None  # a call will count: the host copy goes stale
        return self.on_device[index]

    def _device(self) -> torch.Tensor:
        if self._copied is None:
            self._copied = self.on_device.cpu()
        return self._copied

    def routed(self) -> torch.Tensor:
        """Entries per expert over every call, [layers, experts], on the host."""
        return self.on_host + self._device()[:, :-1]

    def copy_back(self) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """The device counts as the work queued so far leaves them, on their way to the host (pinned memory,
        an event to wait for), without waiting for that work: a window queued ahead takes its counts so."""
        if self.on_device.device.type != "cuda":
            return self.on_device.clone(), None
        host = torch.empty(self.on_device.shape, dtype=self.on_device.dtype, pin_memory=True)
        host.copy_(self.on_device, non_blocking=True)
        with torch.cuda.device(self.on_device.device):
            copied = torch.cuda.Event()
            copied.record()
        return host, copied

    def far(self) -> torch.Tensor:
        """Per layer, the in-place calls' entries read over PCIe."""
        return self._device()[:, -1]


class GpuTieredExperts(Experts):
    def __init__(self, slots: GpuLayerSlots, pcie_frac: float = 0.0, streams: bool = True,
                 staging: Staging | None = None, counts: DeviceCounts | None = None, index: int = 0,
                 lender: Lender | None = None):
        self.slots = slots
        self.lender = lender  # lends prompt chunks their outputs in cache slots (None: `--no-prefill-borrow`)
        # the stacks reading misses that cross PCIe from the staging buffers (None: the kernel reads host memory)
        self._staged = staging.stacks(slots) if staging is not None else None
        self.pcie_frac = pcie_frac  # share of a decode window's missed experts read over PCIe
        # the GPU reads host memory itself (in place, or staging a window's misses) only where it is pinned;
        # experts left in the file's memory map are copied by the host
        self.pinned = slots.device.type != "cuda" or all(s.blocks.is_pinned() for s in slots.host)
        if not self.pinned and staging is None:
            raise ValueError("experts left in the file's memory map need staging: the GPU cannot read them in place")
        self.streams = streams  # prompt chunks read their misses over PCIe (else on the CPU)
        experts, device = slots.experts, slots.device
        # this call's slot table (with staging: what `triton_moe.stage_far` made of `unsynced_table`)
        self.table = torch.empty(experts, dtype=torch.int32, device=device)
        # the table of the calls that never sync: every uncached expert read over PCIe (staged or in place)
        self.unsynced_table = torch.empty(experts, dtype=torch.int32, device=device)
        self._unsynced_version = -1
        self._stats = ExpertStats()
        # this layer's row of the counts (`DeviceCounts`: its device's layers together)
        self.counts, self.index = counts or DeviceCounts(1, experts, device), index
        self._routed_host = self.counts.on_host[index]  # a view: the calls that read the routing back count here
        self._c_stacks = c_stacks(*slots.host)  # what the CPU's pairs run over, in one C call
        if self._c_stacks is None:
            raise ValueError("the GPU tier's host stacks must be blocks or float32 in host memory")

    @property
    def routed(self) -> torch.Tensor:
        """Entries per expert over every call (the profile), on the host."""
        return self.counts.routed()[self.index]

    def stats(self) -> ExpertStats:
        return self.host_stats().read_over_pcie(int(self.counts.far()[self.index]))

    def host_stats(self) -> ExpertStats:
        """The entries as the host counted them, the in-place calls' far ones still as `vram` (`stats`
        moves them; `Tier.stats` does it for every layer at once). Read only."""
        return self._stats

    def reset_counts(self) -> None:
        self._stats = ExpertStats()
        self._routed_host.zero_()
        self.counts.layer(self.index).zero_()

    def split_misses(self, missing: list[int], counts: torch.Tensor, rows: int) -> tuple[list[int], list[int]]:
        """(read over PCIe, run on the CPU): a prompt chunk streams all its misses; a decode window sends
        the `pcie_frac` share of them with the most entries over PCIe."""
        if rows > MATVEC_ROWS and self.streams:
            return missing, []
        by_count = sorted(missing, key=lambda e: (-int(counts[e]), e))
        far = round(self.pcie_frac * len(by_count))
        return by_count[:far], by_count[far:]

    def replayable(self, rows: int) -> bool:
        return rows <= MATVEC_ROWS and self.pcie_frac >= 1 and self.pinned  # the in-place path: no host sync

    def before_replay(self) -> None:
        """The unsynced calls' table after the slots changed; the device counts' host copy marked stale (a
        call counts into them)."""
        if self._unsynced_version != self.slots.version:
            every = torch.arange(self.slots.experts, dtype=torch.int32)
            cached = self.slots.slot_of
            self.unsynced_table.copy_(torch.where(cached >= 0, cached, triton_moe.far_slot(every)))
            self._unsynced_version = self.slots.version
        self.counts.layer(self.index)

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        n, k = ids.shape
        if self.replayable(n):
            return self._unsynced(x, weights, ids, residual)
        out = None
        if self.lender is not None and n > MATVEC_ROWS:  # before the table is read: the loan evicts slots
            gate, _, down = self.slots.stacks
            out = self.lender.outputs(n * k, gate.n, down.n, x)
        ids_host = ids.cpu()  # the layer's one host sync: it decides who computes each expert
        counts = torch.bincount(ids_host.reshape(-1), minlength=self.slots.experts)
        self._routed_host += counts
        table = self.slots.slot_of.clone()
        routed = counts.nonzero().flatten().tolist()
        far, on_cpu = self.split_misses([e for e in routed if table[e] < 0], counts, n)
        # read before the GPU work is queued: a read after it would wait for it
        x_host = x.float().cpu() if on_cpu else None
        if self._staged is None:  # the kernel reads the far experts in place
            for e in far:
                table[e] = triton_moe.far_slot(e)
            self.table.copy_(table)
            y, _ = triton_moe.swiglu_experts(*self.slots.stacks, x, ids, self.table, out=out)
        else:
            y = self._staged_passes(x, ids, table, far, out)
        patch, cpu_us = (self._on_cpu(x_host, ids_host, on_cpu) if x_host is not None else (None, 0))
        far_n, cpu_n = (int(counts[part].sum()) if part else 0 for part in (far, on_cpu))
        s = self._stats
        s.lookups += n * k
        s.vram += n * k - far_n - cpu_n
        s.pcie += far_n
        s.cpu += cpu_n
        s.cpu_us += cpu_us
        return combine(y, weights, patch=patch, residual=residual)

    def _staged_passes(self, x: torch.Tensor, ids: torch.Tensor, table: torch.Tensor, far: list[int],
                       out: triton_moe.Outputs | None) -> torch.Tensor:
        """The kernel's outputs for the cached experts (`table`) and the `far` ones, these copied whole by DMA
        into the staging entries: as many a pass as the staging holds (a prompt chunk's misses may need
        several), every pass writing its pairs into the same outputs (`out`, or new ones)."""
        entries = self._staged[0].far.shape[0]
        out = out or triton_moe.Outputs.new(ids.numel(), self._staged[0], self._staged[2], x)
        for start in range(0, max(len(far), 1), entries):
            part = far[start:start + entries]
            for i, e in enumerate(part):
                table[e] = triton_moe.far_slot(i)
                for host, stack in zip(self.slots.host, self._staged, strict=True):
                    stack.far[i].copy_(host.blocks[e], non_blocking=True)
            self.table.copy_(table)
            triton_moe.swiglu_experts(*self._staged, x, ids, self.table, out=out)
            table.fill_(triton_moe.SKIP)  # the next pass: its far experts only
        return out.y

    def _unsynced(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  residual: torch.Tensor | None) -> torch.Tensor:
        """A decode window whose misses all cross PCIe, without a host sync: the kernel reads cached
        experts from their slots and the others from the staging buffers, where the GPU copied them
        (or, without staging, in place in pinned host memory), and the entries are counted on the
        device. So the window stays as asynchronous as with every expert resident."""
        n, k = ids.shape
        self.before_replay()
        flat = ids.reshape(-1)
        counts = self.counts.layer(self.index)
        counts[:-1].scatter_add_(0, flat, torch.ones_like(flat))
        counts[-1] += (self.unsynced_table[flat] < 0).sum()
        routing = triton_moe.routing_of(ids, self.slots.experts, self.slots.stacks[0].gemm_m)
        stacks, table = self.slots.stacks, self.unsynced_table
        if self._staged is not None:
            triton_moe.stage_far(stacks, self._staged, table, routing, self.table)
            stacks, table = self._staged, self.table
        y, _ = triton_moe.swiglu_experts(*stacks, x, ids, table, routing)
        self._stats.lookups += n * k
        self._stats.vram += n * k  # less the far entries, read from the device in `stats`
        return combine(y, weights, residual=residual)

    def _on_cpu(self, x: torch.Tensor, ids: torch.Tensor, experts: list[int]
                ) -> tuple[tuple[torch.Tensor, torch.Tensor], int]:
        """The pairs of `experts` computed on the CPU: (their flat pair indices, outputs) on the GPU, and
        the microseconds the CPU spent: every pair in one C call (`kernels/ops.py` `swiglu_experts`, each
        pair a row of its own with weight 1, so its output exactly; one product per expert had cost three
        parallel regions and the Python between them)."""
        t0 = time.perf_counter()
        flat = ids.reshape(-1)
        idx = torch.isin(flat, torch.tensor(experts)).nonzero().flatten()
        out = cpu_ops.swiglu_experts(self._c_stacks, x[idx // ids.shape[1]], flat[idx, None], torch.ones(len(idx), 1))
        spent = round((time.perf_counter() - t0) * 1e6)
        device = self.slots.device
        return (idx.to(device), out.to(device)), spent


@dataclass(frozen=True)
class MissTimes:
    """What `measure_pcie_frac` found: the fastest share of misses over PCIe, one missed entry's cost
    each way (None: the GPU cannot read host memory here), and the times of every share tried."""

    share: float
    pcie_us: float | None
    cpu_us: float
    text: str


def measure_pcie_frac(layer: GpuTieredExperts, reps: int = 5) -> MissTimes:
    """`--pcie-frac -1`: time one decode row whose experts all miss (up to 8 of `layer`'s uncached
    experts) with every miss over PCIe (no host sync), every miss on the CPU, and the share
    that would make the two finish together; the fastest wins."""
    device = layer.slots.device
    missing = (layer.slots.slot_of < 0).nonzero().flatten()[:8]
    k = missing.numel()
    if not k:
        raise ValueError("measure_pcie_frac needs a layer with uncached experts")
    hidden = layer.slots.host[0].experts[0].in_features
    x = torch.zeros(1, hidden, dtype=torch.bfloat16, device=device)
    weights = torch.full((1, k), 1 / k, device=device)
    ids = missing.to(device=device, dtype=torch.int64).view(1, k)

    def seconds(frac: float) -> float:
        layer.pcie_frac = frac
        layer(x, weights, ids)  # compiles the kernels, warms the CPU pool
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            layer(x, weights, ids)
        torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) / reps

    try:
        times = {0.0: seconds(0.0)}
        try:
            times[1.0] = seconds(1.0)
        except RuntimeError as exc:  # the kernel cannot read host memory on this system
            return MissTimes(0.0, None, times[0.0] * 1e6 / k,
                             f"misses on the CPU (the GPU cannot read host memory here: {exc})")
        balanced = round(times[0.0] / (times[0.0] + times[1.0]), 2)
        if 0.0 < balanced < 1.0:
            times[balanced] = seconds(balanced)
    finally:
        layer.reset_counts()
    best = min(times, key=times.get)
    measured = ", ".join(f"{share:g}: {t * 1e6:.0f} us" for share, t in times.items())
    return MissTimes(best, times[1.0] * 1e6 / k, times[0.0] * 1e6 / k,
                     f"one row's {k} missed experts by share over PCIe: {measured}")
