"""Routed experts behind one interface: `experts(x, weights, ids) -> y` and `experts.stats()`.

`route` picks each row's experts; an `Experts` object runs them. `ResidentExperts` holds every
expert on the model's device and picks its path once, at load: grouped GEMMs on CUDA (Hopper and
newer, bf16), one C call for a whole window or prompt chunk on the CPU (`kernels/moe_cpu.c`), else one
product per routed expert over the rows routed to it; `resident_experts` picks
`BlockExperts` (engine/experts_blocks.py, the fused MoE kernel over the file's blocks) instead where
the store kept a layer's stacks in their blocks on CUDA. The expert tier (a
VRAM cache of experts with misses served elsewhere) is another `Experts` behind the same calls.

Every path combines a row's k expert outputs in a fixed order, after un-sorting them by a scatter
with distinct indices (never an atomic accumulation), so a row's result does not depend on how the
other rows of the call were routed or scheduled.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from engine.kernels import cpu as cpu_kernels
from engine.kernels import gpu as gpu_kernels
from engine.kernels import ops as cpu_ops
from engine.layers import add
from engine.weights import Linear, LinearStack


@dataclass
class ExpertStats:
    """Routed (row, expert) entries served, counted per call: from device memory, over PCIe, by the CPU;
    `cpu_us`: time spent computing the CPU's entries (measured where the CPU computes them)."""

    lookups: int = 0
    vram: int = 0
    pcie: int = 0
    cpu: int = 0
    cpu_us: int = 0

    # field by field: these run several times a decode window, and a generic loop over the fields costs
    # ~4 us a call (dataclasses.astuple, which deep-copies, ~60 us)
    def __add__(self, other: ExpertStats) -> ExpertStats:
        return ExpertStats(self.lookups + other.lookups, self.vram + other.vram, self.pcie + other.pcie,
                           self.cpu + other.cpu, self.cpu_us + other.cpu_us)

    def __sub__(self, other: ExpertStats) -> ExpertStats:
        return ExpertStats(self.lookups - other.lookups, self.vram - other.vram, self.pcie - other.pcie,
                           self.cpu - other.cpu, self.cpu_us - other.cpu_us)

    def read_over_pcie(self, entries: int) -> ExpertStats:
        """These figures with `entries` of the `vram` ones moved to `pcie` (the GPU tier's in-place calls
        count their entries read over PCIe on the device, read back later)."""
        return ExpertStats(self.lookups, self.vram - entries, self.pcie + entries, self.cpu, self.cpu_us)

    def share(self, rows: int) -> ExpertStats:
        """One row's part of a window's entries (every row routes the same number of entries)."""
        return ExpertStats(self.lookups // rows, self.vram // rows, self.pcie // rows, self.cpu // rows,
                           self.cpu_us // rows)


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax router then top-k (Qwen3-MoE order). Returns weights [N, k] (float32) and ids [N, k]. On CUDA
    (k a power of two) two Triton launches (`triton_moe.route`) where torch takes about six; on the CPU one C call."""
    if x.is_cuda and gpu_kernels.available() and router.dtype == torch.float32 and not top_k & (top_k - 1):
        from engine.kernels.triton_moe import (
            route as fused,  # imports Triton, so only when a CUDA tensor comes
        )

        return fused(x, router, top_k, normalize)
    if cpu_ops.usable(x) and router.dtype == torch.float32 and x.dim() == 2:
        return cpu_ops.route(x, router, top_k, normalize)
    probs = torch.softmax(F.linear(x.float(), router), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class Experts:
    """Implementations count the entries they serve into `self._stats`."""

    _stats: ExpertStats

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        """Each row of x through its routed experts (`ids` [rows, k]), the outputs weighted (`weights`)
        and summed in the order of choices; plus `residual` when given, with the bits of `residual + `
        that sum (on CUDA in the sum's launch)."""
        raise NotImplementedError

    def stats(self) -> ExpertStats:
        return self._stats + ExpertStats()  # a copy

    def counted(self) -> ExpertStats:
        """The entries counted on the host so far (`stats` may add counts kept on the device)."""
        return self._stats + ExpertStats()

    def recount(self, entries: ExpertStats) -> None:
        """Add `entries` to the host's counts: a CUDA graph replays a call without its Python."""
        self._stats = self._stats + entries

    def replayable(self, rows: int) -> bool:
        """Whether a call of `rows` rows can be captured in a CUDA graph (no host sync, no host work)."""
        return False

    def before_replay(self) -> None:
        """Bring what a captured call reads up to date (called before each replay)."""


def by_expert(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A window's (row, expert) pairs sorted by expert, stably: (the flat expert ids, the sort order);
    pair `order[i]` is row `order[i] // k`."""
    flat = ids.reshape(-1)
    return flat, torch.argsort(flat, stable=True)


class ResidentExperts(Experts):
    """SwiGLU experts, all resident on `device`: gate/up `[E, F, H]`, down `[E, H, F]`."""

    def __init__(self, gate: LinearStack, up: LinearStack, down: LinearStack, device: torch.device):
        self.gate, self.up, self.down = gate, up, down
        self.on_gpu = device.type == "cuda"
        # every stack dense: on CUDA a layer can mix stacks kept in blocks with dense ones (types the
        # kernels do not read), and those run one product per routed expert
        self.grouped = (self.on_gpu and all(s.dense is not None and s.dense.dtype == torch.bfloat16
                                            for s in (gate, up, down)) and grouped_mm_runs(device))
        self.c_stacks = None if self.on_gpu else c_stacks(gate, up, down)
        self._stats = ExpertStats()

    def replayable(self, rows: int) -> bool:
        return self.grouped

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        n, k = ids.shape
        t0 = time.perf_counter()
        if self.c_stacks is not None and cpu_ops.usable(x):  # a window or a prompt chunk: one C call
            out = with_residual(cpu_ops.swiglu_experts(self.c_stacks, x, ids, weights), residual)
        else:
            flat, order = by_expert(ids)
            rows = order // k
            y = self._grouped(x[rows], flat, order) if self.grouped else self._per_expert(x[rows], flat[order])
            out = combine(y, weights, order, residual=residual)
        self._count(n * k, time.perf_counter() - t0)
        return out

    def _count(self, entries: int, seconds: float) -> None:
        self._stats.lookups += entries
        if self.on_gpu:
            self._stats.vram += entries
        else:
            self._stats.cpu += entries
            self._stats.cpu_us += round(seconds * 1e6)

    def _grouped(self, xs: torch.Tensor, flat: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        """Every routed expert read once, no host sync, no weight copies."""
        return grouped_swiglu(xs, flat, self.gate.dense.shape[0], lambda: self.gate.dense, lambda: self.up.dense,
                              lambda: self.down.dense)

    def _per_expert(self, xs: torch.Tensor, sorted_ids: torch.Tensor) -> torch.Tensor:
        """Rows sorted by expert; one product per routed expert over its rows."""
        y = torch.empty(xs.shape, dtype=xs.dtype, device=xs.device)
        experts, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
        start = 0
        for expert, count in zip(experts.tolist(), counts.tolist(), strict=True):
            y[start : start + count] = swiglu(self.gate.experts[expert], self.up.experts[expert],
                                              self.down.experts[expert], xs[start : start + count])
            start += count
        return y


def grouped_swiglu(xs: torch.Tensor, flat: torch.Tensor, experts: int, gate: Callable[[], torch.Tensor],
                   up: Callable[[], torch.Tensor], down: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Each pair's SwiGLU through its expert, xs [pairs, H] sorted by expert (`flat`: the pairs' experts, as
    `by_expert` gives them): one grouped GEMM per projection. `gate`, `up` and `down` give their stack
    [experts, n, k] when its product comes (a dequantized copy is made then: one alive at a time)."""
    offsets = expert_offsets(flat, experts)
    h = F.silu(grouped_mm(xs, gate(), offsets)) * grouped_mm(xs, up(), offsets)
    return grouped_mm(h, down(), offsets)


def expert_offsets(flat: torch.Tensor, experts: int) -> torch.Tensor:
    """int32 [experts]: where each expert's pairs end once sorted by expert (`by_expert`), for `grouped_mm`."""
    # not bincount: on CUDA it reads the max back to size its output, a host sync per layer
    counts = torch.zeros(experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    return torch.cumsum(counts, 0).to(torch.int32)


def grouped_mm(xs: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """xs [pairs, k] sorted by expert times each expert's w [experts, n, k] transposed: [pairs, n], one
    grouped GEMM (torch._grouped_mm)."""
    return torch._grouped_mm(xs, w.transpose(1, 2), offs=offsets)


@functools.cache
def grouped_mm_runs(device: torch.device) -> bool:
    """Whether torch's grouped GEMM runs on `device` (CUDA builds take it on Hopper and newer GPUs): one tiny
    product tried."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        x = torch.zeros(16, 16, dtype=torch.bfloat16, device=device)
        grouped_mm(x, torch.zeros(2, 16, 16, dtype=torch.bfloat16, device=device),
                   torch.tensor([8, 16], dtype=torch.int32, device=device))
    except (RuntimeError, NotImplementedError, AssertionError):  # AssertionError: a build without CUDA
        return False
    return True


def swiglu(gate: Linear, up: Linear, down: Linear, x: torch.Tensor) -> torch.Tensor:
    """One expert over its rows: down(silu(gate(x)) * up(x))."""
    return down(F.silu(gate(x)) * up(x))


def c_stacks(*stacks: LinearStack) -> tuple[tuple[int, torch.Tensor], ...] | None:
    """The stacks as the CPU kernels read them (`kernels/ops.py` `swiglu_experts`: a window's or chunk's experts
    in one call): (GGUF type, blocks) or (F32, float32 values) each, contiguous in host memory (the type |
    `PACKED_STACK` for packed blocks); None when one is neither."""
    out = []
    for s in stacks:
        if s.blocks is not None and s.qtype is not None and s.blocks.is_cpu and s.blocks.is_contiguous():
            out.append((int(s.qtype) | (cpu_kernels.PACKED_STACK if s.packed else 0), s.blocks))
        elif s.dense is not None and s.dense.dtype == torch.float32 and s.dense.is_cpu and s.dense.is_contiguous():
            out.append((int(Q.F32), s.dense))
        else:
            return None
    return tuple(out)


def resident_experts(gate: LinearStack, up: LinearStack, down: LinearStack, device: torch.device) -> Experts:
    """Every expert on `device`: stacks the store kept in their blocks on CUDA run through the fused MoE
    kernel (`engine.experts_blocks.BlockExperts`), other stacks as `ResidentExperts`."""
    if device.type == "cuda" and all(s.blocks is not None for s in (gate, up, down)):
        from engine.experts_blocks import BlockExperts  # imports Triton, so only when it is used

        return BlockExperts(gate, up, down, device)
    return ResidentExperts(gate, up, down, device)


def combine(y: torch.Tensor, weights: torch.Tensor, order: torch.Tensor | None = None,
            patch: tuple[torch.Tensor, torch.Tensor] | None = None,
            residual: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's k expert outputs weighted and summed in a fixed order. `y` [rows * k, H] in flat
    (row, choice) order (the fused MoE kernel's), or in expert-sorted order with `order` (the flat pair
    at each sorted position); `patch` (flat pair indices, their outputs) replaces the outputs of pairs
    computed elsewhere (not with `order`); `residual` is added (`with_residual`). On CUDA one Triton launch
    (`triton_moe.weighted_sum`), which reads sorted outputs in place."""
    n, k = weights.shape
    at = None
    if order is not None:  # each flat pair's sorted position (distinct indices: a plain scatter)
        if patch is not None:
            raise ValueError("combine takes a patch of flat outputs only, not with sorted ones")
        at = torch.empty_like(order)
        at[order] = torch.arange(order.numel(), dtype=order.dtype, device=order.device)
    if patch is not None:
        y[patch[0]] = patch[1].to(y.dtype)
    if y.is_cuda and gpu_kernels.available():
        from engine.kernels.triton_moe import weighted_sum  # imports Triton, so only when a CUDA tensor comes

        # scattering a 3,440-token read's sorted outputs back (27,520 rows) took 268 us a layer on an H100
        return weighted_sum(y, weights, residual, at)
    if at is not None:
        y = y[at]
    return with_residual((y.view(n, k, -1).float() * weights[..., None]).sum(dim=1).to(y.dtype), residual)


def with_residual(out: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """`residual + out` (out alone without one): what an `Experts` call returns."""
    return out if residual is None else add(residual, out)
