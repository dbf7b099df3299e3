"""`Tier`: the model's expert cache (one `LayerSlots` per layer), its seeding, its adaptation rounds
and its figures; `install_tier` puts it in place of a model's resident experts.

Slots: `--expert-cache N` is the total over all layers, spread evenly (N // layers each, one more
for the first N % layers). Seeding fills every slot at load: a routing profile's most routed experts
per layer; without one the experts in id order (nothing ranks them yet, and an expert in a slot can
be hit where an empty slot cannot). A static cache (`--adapt-every 0`) seeded without a profile then
takes one round after `SEED_WINDOWS` windows (`AdaptPolicy.seeding`: the first windows' counts
alone rank the experts) and never changes again; a fixed cache (exact runs) stays as seeded.
Rounds run every `policy.every` decode windows (`window_done`, called by the loop after each
window), never while only a prompt is being read; the adaptation counts are the decode windows'
routing (the `Counted` that `window_start` returns to the one after the window, every layer's at
once, the device's counts copied back without waiting, so a window can be queued before the last
one's tokens are read), so a long prompt read between windows does not re-rank the cache (the saved
profile counts every call).
A round is blocking by default: its copies finish before the next window launched (with windows
queued ahead, the one already queued runs on the slots as they were). With `asynchronous`
(`--adapt-async 1`) a `Copier` fills the evicted slots on a helper thread (on the GPU, on a copy
stream) and the experts are published at the first window boundary after the copies are done; a
round that comes due while one is in flight runs after the window that finds the copier free.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.experts import ExpertStats, ResidentExperts
from engine.memory import MIB, device_key
from engine.models.base import Model
from engine.tier.copier import Copier
from engine.tier.experts import TieredExperts
from engine.tier.policy import AdaptPolicy, Swap, plan_round
from engine.tier.profile import RoutingProfile
from engine.tier.sizing import staging_entries
from engine.tier.slots import LayerSlots, SlotTable

if TYPE_CHECKING:
    from engine.tier.gpu_experts import DeviceCounts, GpuTieredExperts, MissTimes

SEED_WINDOWS = 4  # a static cache seeded without a profile re-seeds from this many windows
WINDOW_LOG = 4096  # per-window entries kept (`Tier.window_log`)
HOT_EXPERTS = 4  # the hottest experts `figures` names (the dashboard's line holds 4)


class TierError(ValueError):
    pass


@dataclass
class Counted:
    """A tier's counts at one point of the queued work: the entries the host counted, the routing per layer
    counted on the host, and each device's counts on their way back (`DeviceCounts.copy_back`)."""

    host: ExpertStats
    routed: torch.Tensor
    device: list[tuple[torch.Tensor, torch.cuda.Event | None]] = field(default_factory=list)

    def resolved(self) -> tuple[ExpertStats, torch.Tensor]:
        """(entries served, routing per layer), once the device counts are back."""
        for _, copied in self.device:
            if copied is not None:
                copied.synchronize()
        if not self.device:
            return self.host, self.routed
        counts = torch.cat([c for c, _ in self.device])
        return self.host.read_over_pcie(int(counts[:, -1].sum())), self.routed + counts[:, :-1]

    def minus(self, before: Counted) -> tuple[ExpertStats, torch.Tensor]:
        """What was counted between `before` and this point: entries served and routing per layer."""
        (served, routed), (served0, routed0) = self.resolved(), before.resolved()
        return served - served0, routed - routed0


class Tier:
    def __init__(self, layers: list[TieredExperts] | list[GpuTieredExperts], policy: AdaptPolicy,
                 mode: str = "simulated", asynchronous: bool = False):
        self.layers = layers
        self.policy = policy
        self.copier = Copier([layer.slots for layer in layers]) if asynchronous else None
        self._deferred = False  # a round came due while the copier was busy
        self.mode = mode  # gpu: VRAM slots, misses over PCIe or on the CPU; simulated: host slots, all on the CPU
        self.miss_times: MissTimes | None = None  # the GPU tier's measured cost of a miss (`choose_pcie`)
        self.windows = 0
        self.rounds = 0
        self.swaps = 0  # experts copied into slots by rounds (the seeding at load not counted)
        self.adapt_wait_s = 0.0  # time windows waited for rounds
        self.window_log: deque[ExpertStats] = deque(maxlen=WINDOW_LOG)  # entries served per decode window
        # the decode windows' routing counts, decayed by the rounds, [layers, experts]
        self.counts = torch.zeros(len(layers), layers[0].slots.experts if layers else 0, dtype=torch.float64)
        self._groups = _count_groups(layers)
        self._ranked = False  # seeded from a profile (a static cache then takes no seed round)
        # the GPU tier's lenders (one a device: `engine.tier.loan`), none with `--no-prefill-borrow`
        self.lenders = list(dict.fromkeys(lender for layer in layers if (lender := getattr(layer, "lender", None))))
        for lender in self.lenders:
            lender.settle = self._finish_round

    @property
    def slots(self) -> int:
        return sum(layer.slots.size for layer in self.layers)

    @property
    def experts_total(self) -> int:
        return sum(layer.slots.experts for layer in self.layers)

    def cached(self) -> int:
        return sum(layer.slots.cached() for layer in self.layers)

    def cache_bytes(self, device: torch.device | None = None) -> int:
        """The slots' bytes (on `device` only, when given)."""
        return sum(layer.slots.nbytes() for layer in self.layers
                   if device is None or getattr(layer.slots, "device", None) == device)

    def seed(self, profile: RoutingProfile | None) -> None:
        """Fill every layer's slots: its most routed experts by `profile`, or without one its first
        experts by id (not counted as swaps)."""
        if profile is not None:
            profile.check_shape(len(self.layers), self.layers[0].slots.experts)
        self._ranked = profile is not None
        for i, layer in enumerate(self.layers):
            hot = list(range(layer.slots.experts))
            if profile is not None:
                hot.sort(key=lambda e, counts=profile.counts[i]: -counts[e])  # stable: ties by id
            for slot, expert in enumerate(hot[: layer.slots.size]):
                layer.slots.load(slot, expert)

    def profile(self, model_name: str) -> RoutingProfile:
        """The routing counts so far (never decayed), to save."""
        return RoutingProfile(model_name, self._routed().tolist())

    def stats(self) -> ExpertStats:
        """Every layer's entries served so far (`Model.expert_stats` with a tier): on the GPU the PCIe
        entries counted on each device read at once."""
        if self._groups is None:
            return sum((layer.stats() for layer in self.layers), ExpertStats())
        return self._host_stats().read_over_pcie(sum(int(group.far().sum()) for group in self._groups))

    def _host_stats(self) -> ExpertStats:
        """On the GPU: the entries as the host counted them (`GpuTieredExperts.host_stats`), over every layer."""
        return sum((layer.host_stats() for layer in self.layers), ExpertStats())

    def _routed(self) -> torch.Tensor:
        """Every layer's routing counts over every call, [layers, experts]: on the GPU one read per device."""
        if self._groups is None:
            return torch.stack([layer.routed for layer in self.layers])
        return torch.cat([group.routed() for group in self._groups])

    def window_start(self) -> Counted:
        """Before a decode window is queued: the slots prompt chunks borrowed given back, a round's finished
        copies published; the counts as they stand."""
        self.repay()
        if self.copier is not None:
            self.copier.publish_ready()
        return self.counted()

    def repay(self) -> None:
        """Copy back the experts whose slots prompt chunks borrowed, and serve them from their slots again."""
        for lender in self.lenders:
            lender.repay()

    def counted(self) -> Counted:
        """The counts as the work queued so far leaves them, read back without waiting for it."""
        if self._groups is None:
            return Counted(self.stats(), self._routed())
        return Counted(self._host_stats(), torch.cat([group.on_host for group in self._groups]),
                       [group.copy_back() for group in self._groups])

    def can_queue_ahead(self, rows: int) -> bool:
        """Whether a window of `rows` can be queued before the last one's tokens are read: on the GPU when
        no layer syncs the host in it (every miss over PCIe); always on the simulated tier, whose windows
        compute on the CPU as they are launched."""
        return self._groups is None or all(layer.replayable(rows) for layer in self.layers)

    def window_done(self, before: Counted, after: Counted) -> ExpertStats:
        """After a decode window (its tokens read): count its routing (the counts `window_start` took and
        those after it), then run a round when one is due. Returns the entries it served."""
        served, routed = after.minus(before)
        self.counts += routed
        self.windows += 1
        self.window_log.append(served)
        if self.policy.due(self.windows) or self._deferred:
            self._deferred = self.copier is not None and self.copier.busy
            if not self._deferred:
                self._round(self.policy)
        elif self.windows == SEED_WINDOWS and self.policy.every == 0 and not self._ranked:
            self._round(self.policy.seeding())
        return served

    def _round(self, policy: AdaptPolicy) -> None:
        t0 = time.perf_counter()
        plan = plan_round(self.counts, [layer.slots.expert_at for layer in self.layers], policy)
        self._apply(plan)
        self.counts.mul_(self.policy.decay)
        self.rounds += 1
        self.swaps += len(plan)
        self.adapt_wait_s += time.perf_counter() - t0

    def _apply(self, plan: list[Swap]) -> None:
        if self.copier is not None:
            self.copier.start(plan)
            return
        for swap in plan:
            self.layers[swap.layer].slots.load(swap.slot, swap.expert)

    def settle(self) -> None:
        """Give borrowed slots back, wait for a round's copies in flight and publish them (at quit, or where a
        settled cache is needed)."""
        self.repay()
        self._finish_round()

    def _finish_round(self) -> None:
        if self.copier is not None:
            self.copier.finish()

    def slots_by_device(self) -> dict[str, int]:
        """The GPU tier's cache slots per device, keyed as STATS `memory` keys them; {} for the simulated tier."""
        out: dict[str, int] = {}
        for layer in self.layers:
            device = getattr(layer.slots, "device", None)
            if device is not None:
                key = device_key(device)
                out[key] = out.get(key, 0) + layer.slots.size
        return out

    def hottest(self, n: int = HOT_EXPERTS) -> list[dict[str, int | float | bool]]:
        """The `n` experts with the largest share of their layer's decayed routing counts (what the
        rounds rank by), each with whether a slot holds it; none before the first decode window."""
        hot: list[tuple[float, int, int]] = []
        for layer, counts in enumerate(self.counts):
            total = float(counts.sum())
            if total > 0:
                top = torch.topk(counts, min(n, len(counts)))
                hot += [(float(c) / total, layer, int(e)) for c, e in zip(top.values, top.indices, strict=True) if c > 0]
        hot.sort(key=lambda h: (-h[0], h[1], h[2]))
        return [{"layer": layer, "expert": expert, "share": round(share, 4),
                 "cached": bool(self.layers[layer].slots.slot_of[expert] >= 0)} for share, layer, expert in hot[:n]]

    def figures(self) -> dict[str, object]:
        """The tier's own STATS fields (the entries' counts come from the loop)."""
        return {"mode": self.mode, "swaps": self.swaps, "adapt_rounds": self.rounds,
                "adapt_wait_ms": round(self.adapt_wait_s * 1000 / max(self.windows, 1), 4),
                "adapt_wait_total_ms": round(self.adapt_wait_s * 1000, 3), "hot": self.hottest(),
                "experts_cached": self.cached(), "experts_total": self.experts_total, "slots": self.slots,
                "device_slots": self.slots_by_device(), "cache_mib": round(self.cache_bytes() / MIB, 1)}


def _count_groups(layers: list[TieredExperts] | list[GpuTieredExperts]) -> list[DeviceCounts] | None:
    """The GPU tier's `DeviceCounts`, when together they hold exactly its layers' rows in layer order
    (`_gpu_layers` builds them so); None otherwise (the simulated tier: each layer counts on its own)."""
    groups = list(dict.fromkeys(getattr(layer, "counts", None) for layer in layers))
    if None in groups:
        return None
    rows = [(group, i) for group in groups for i in range(group.layers)]
    return groups if rows == [(layer.counts, layer.index) for layer in layers] else None


def _gpu_layers(model: Model, stacks: list, per_layer: list[int], pcie_frac: float,
                borrow: bool) -> list[GpuTieredExperts]:
    """Each layer's VRAM slots on its stage's device (with `borrow` in one `SlotArena` a device, whose
    `Lender` its layers share); the staging buffer and the counts per device."""
    from engine.tier.gpu_experts import DeviceCounts, GpuTieredExperts  # imports Triton: only when used
    from engine.tier.gpu_slots import GpuLayerSlots, Staging
    from engine.tier.loan import Lender, SlotArena

    devices = [model.placement.device_of(i) for i in range(len(stacks))]
    layers, h = [], model.hyper
    for device in dict.fromkeys(devices):
        mine = [(s, n) for s, n, d in zip(stacks, per_layer, devices, strict=True) if d == device]
        try:
            if borrow:
                arena = SlotArena([shape for s, n in mine for shape in GpuLayerSlots.buffer_shapes(s, n)], device)
                slot_sets = [GpuLayerSlots(*s, n, device, buffers=tuple(arena.buffers[3 * i : 3 * i + 3]))
                             for i, (s, n) in enumerate(mine)]
                lender = Lender(arena, slot_sets)
            else:
                slot_sets, lender = [GpuLayerSlots(*s, n, device) for s, n in mine], None
        except ValueError as exc:
            raise TierError(f"--expert-cache: {exc}") from None
        staging = Staging(slot_sets, staging_entries(h.experts, h.experts_used))
        counts = DeviceCounts(len(slot_sets), h.experts, device)
        layers += [GpuTieredExperts(s, pcie_frac, staging=staging, counts=counts, index=i, lender=lender)
                   for i, s in enumerate(slot_sets)]
    return layers


def split_slots(total: int, layers: int, experts: int) -> list[int]:
    """`total` slots spread over `layers` (the first `total % layers` get one more), at most `experts` each."""
    if total < 0:
        raise TierError(f"--expert-cache must be 'auto' or a number of slots >= 0, got {total}")
    base, extra = divmod(total, layers)
    return [min(experts, base + (i < extra)) for i in range(layers)]


def install_tier(model: Model, slots: int | list[int], policy: AdaptPolicy, profile: RoutingProfile | None = None,
                 pcie_frac: float = 0.0, asynchronous: bool = False, borrow: bool = True) -> Tier:
    """Replace the model's per-layer experts by tiered ones over a cache of `slots` slots in all (see
    `split_slots`; or a list: each layer's), seeded from `profile` when given; sets and returns
    `model.tier`. On CUDA the slots are in VRAM on each layer's stage device (`GpuTieredExperts`: the
    model must have kept its experts in host memory, `load_model(host_experts=True)`), on the CPU they
    are simulated (`TieredExperts`). `asynchronous`: rounds copy on a helper thread (and on the GPU on a copy
    stream of their own: `Copier`). `borrow`: the GPU tier's prompt chunks borrow cache slots for their
    MoE buffers (`engine.tier.loan`)."""
    h = model.hyper
    if not h.experts:
        raise TierError("--expert-cache: this model is dense; there are no routed experts to cache")
    stacks = []
    for i, b in enumerate(model.blk):
        ex = getattr(b, "experts", None)
        if isinstance(getattr(ex, "slots", None), SlotTable):  # a tier installed before
            stacks.append(ex.slots.host)
        elif isinstance(ex, ResidentExperts):
            stacks.append((ex.gate, ex.up, ex.down))
        else:
            raise TierError(f"--expert-cache: layer {i} of this {model.arch} model has no SwiGLU expert stacks "
                            "the tier can cache")
    per_layer = split_slots(slots, len(stacks), h.experts) if isinstance(slots, int) else slots
    if model.device.type == "cuda":
        layers = _gpu_layers(model, stacks, per_layer, pcie_frac, borrow)
        mode = "gpu"
    else:
        layers = [TieredExperts(LayerSlots(*s, n)) for s, n in zip(stacks, per_layer, strict=True)]
        mode = "simulated"
    for b, layer in zip(model.blk, layers, strict=True):
        b.experts = layer
    tier = Tier(layers, policy, mode, asynchronous=asynchronous)
    tier.seed(profile)
    model.tier = tier
    return tier
