"""The expert tier's engine flags (`add_tier_flags`), setting the tier up from them (`setup_tier`) and
its closing lines and profile (`finish_tier`)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

import torch

from engine.experts import ExpertStats
from engine.gguf_file import GGUFFile
from engine.hyper import Hyper
from engine.loading import log
from engine.memory import MIB, free_bytes
from engine.models.base import Model
from engine.placement import Placement
from engine.protocol import VRAM_RESERVE_MIB
from engine.tier import (
    FIXED,
    AdaptPolicy,
    RoutingProfile,
    Tier,
    TierError,
    install_tier,
    parse_expert_cache,
    split_slots,
)
from engine.tier.sizing import (
    auto_slots,
    expert_ffn,
    outputs_bytes,
    slot_bytes,
    staging_bytes,
    staging_entries,
)
from engine.tier.tier import SEED_WINDOWS
from engine.weights import MAPPED

GIB = 1 << 30
RAM_SPARE = 2 * GIB  # RAM left beside pinned experts: the engine, the page cache, the rest of the machine


def seed_without_profile(policy: AdaptPolicy) -> str:
    """How a cache seeded without a profile starts (`Tier.seed`), for the start's log line."""
    if policy.every == 0:
        return f"by expert id, then once from the first {SEED_WINDOWS} windows"
    return "by expert id" + (", then from the rounds" if policy.adapts else "")


def add_tier_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--expert-cache", help="expert tier: 'auto' or N cache slots in all (spread over the layers); "
                                          "without it every expert is resident")
    p.add_argument("--expert-profile", help="routing profile (JSON) that seeds the expert cache")
    p.add_argument("--expert-profile-save", help="write the routing counts to this file when the engine quits")
    p.add_argument("--adapt-every", type=int, default=4, help=f"windows between re-ranks; 0 = static, {FIXED} = fixed")
    p.add_argument("--adapt-swaps", type=int, default=96, help="most experts swapped in per re-rank")
    p.add_argument("--adapt-decay", type=float, default=0.7, help="routing counts multiplied by this after a re-rank")
    p.add_argument("--adapt-min-gain", type=float, default=1.5, help="count ratio a swap must clear")
    p.add_argument("--adapt-min-count", type=float, default=3.0,
                   help="routing count (decayed) an uncached expert needs to displace a cached one (0: any)")
    p.add_argument("--adapt-async", type=int, default=0, choices=(0, 1))
    p.add_argument("--pcie-frac", type=float, default=-1.0, help="share of misses read over PCIe (-1: engine's choice)")
    p.add_argument("--vram-reserve-mib", type=int, default=VRAM_RESERVE_MIB,
                   help="VRAM left free beside the expert cache by --expert-cache auto")
    p.add_argument("--mmap-experts", action="store_true",
                   help="GPU tier: leave the routed experts in the file's memory map instead of pinned RAM (the "
                        "engine does so by itself when RAM is short of them)")
    p.add_argument("--no-prefill-borrow", dest="prefill_borrow", action="store_false",
                   help="GPU tier: prompt chunks take their MoE buffers beside the cache (--expert-cache auto "
                        "leaves room for them) instead of borrowing cache slots")


@dataclass(frozen=True)
class TierPlan:
    """What the tier asks of loading: routed experts kept in host memory (the GPU tier: pinned, or
    `weights.MAPPED`), and the VRAM bytes it takes on each device (`str(device)`: its layers' staging, and
    their slots when the size is given) before the batch slots are fitted."""

    host_experts: bool | str = False
    taken: dict[str, int] = field(default_factory=dict)


def plan_tier(args: argparse.Namespace, g: GGUFFile, placement: Placement) -> TierPlan:
    h = Hyper.from_gguf(g)
    if args.expert_cache is None or placement.first.device.type != "cuda" or not h.experts:
        return TierPlan()
    cache = parse_expert_cache(args.expert_cache)
    per_layer = slot_bytes(g, h.layers, h.experts)
    counts = None if cache == "auto" else split_slots(min(cache, h.layers * h.experts), h.layers, h.experts)
    taken, entries = {}, staging_entries(h.experts, h.experts_used)
    for device in placement.devices():
        layers = placement.layers_on(device)
        taken[str(device)] = staging_bytes([per_layer[i] for i in layers], entries) + (
            sum(counts[i] * per_layer[i] for i in layers) if counts else 0)
    return TierPlan(host_experts=host_memory(args.mmap_experts, sum(per_layer) * h.experts), taken=taken)


def host_memory(asked_mapped: bool, nbytes: int) -> bool | str:
    """Where the GPU tier's `nbytes` of routed experts live in host memory: pinned copies (True), or, asked
    or with less RAM available than they take and `RAM_SPARE` beside, left in the file's memory map."""
    available, _ = free_bytes(torch.device("cpu"))
    if asked_mapped or nbytes + RAM_SPARE > available:
        why = "--mmap-experts" if asked_mapped else f"{available / GIB:.1f} GiB of RAM available"
        log(f"routed experts ({nbytes / GIB:.1f} GiB) left in the file's memory map ({why}): pages are read from "
            "the file as they are used; the GPU never reads them itself (misses copied up by the host or run on "
            "the CPU, each layer syncing the host: no decode window replayed from a CUDA graph)")
        return MAPPED
    return True


def setup_tier(args: argparse.Namespace, model: Model) -> dict[str, int | float | str]:
    """Install the expert tier `--expert-cache` asks for; its INFO keys ({} when every expert stays resident)."""
    policy = AdaptPolicy(args.adapt_every, args.adapt_swaps, args.adapt_decay, args.adapt_min_gain, args.adapt_min_count)
    if not (0 <= args.pcie_frac <= 1 or args.pcie_frac == -1):
        raise TierError(f"--pcie-frac must be -1 or in [0, 1], got {args.pcie_frac}")
    cache = parse_expert_cache(args.expert_cache) if args.expert_cache is not None else None
    if cache is not None and not model.hyper.experts:
        log(f"--expert-cache {cache}: this model is dense, there are no routed experts to cache")
        cache = None
    if cache is None:
        if args.expert_profile or args.expert_profile_save:
            raise TierError("--expert-profile/--expert-profile-save need an expert tier (--expert-cache on a MoE model)")
        return {}
    h = model.hyper
    gpu = model.device.type == "cuda"
    if cache == "auto":
        if not gpu:
            log("--expert-cache auto: every expert stays resident: no VRAM to size a cache from on the CPU "
                "(--expert-cache N runs the simulated tier)")
            return {}
        cache = auto_cache(model, args.vram_reserve_mib, borrow=args.prefill_borrow)
    save_dir = os.path.dirname(args.expert_profile_save or "") or "."
    if args.expert_profile_save and not os.path.isdir(save_dir):
        raise TierError(f"--expert-profile-save {args.expert_profile_save}: no directory {save_dir}")
    if isinstance(cache, int) and cache > h.layers * h.experts:
        log(f"--expert-cache {cache}: the model has {h.layers * h.experts} routed experts; caching all of them")
        cache = h.layers * h.experts
    profile = RoutingProfile.load(args.expert_profile) if args.expert_profile else None
    pcie = max(args.pcie_frac, 0.0) if gpu else 0.0
    tier = install_tier(model, cache, policy, profile, pcie_frac=pcie, asynchronous=bool(args.adapt_async),
                        borrow=args.prefill_borrow)
    if gpu:
        pcie = choose_pcie(tier, args.pcie_frac, model.placement)
    elif args.pcie_frac > 0:
        log(f"--pcie-frac {args.pcie_frac:g}: the simulated tier has no PCIe link; misses run on the CPU (pcie_frac=0)")
    if args.adapt_async:
        log("--adapt-async 1: rounds copy on a helper thread" + (" and a copy stream" if gpu else "") +
            "; windows never wait for them, and the new experts serve from the first window after their copies")
    mode = "static" if policy.every == 0 else "fixed" if not policy.adapts else f"every {policy.every} windows"
    where = ("VRAM slots, misses over PCIe or on the CPU beside the GPU" if gpu
             else "simulated: slots in host RAM, cached experts and misses on the CPU")
    log(f"expert tier ({where}): {tier.slots} slots for {tier.experts_total} experts "
        f"({tier.slots / tier.experts_total:.0%}, {tier.cache_bytes() / MIB:.1f} MiB), "
        f"seeded {'from ' + args.expert_profile if profile else seed_without_profile(policy)}, adaptation {mode}")
    if gpu:
        log("prompt chunks " + ("borrow cache slots for their MoE buffers" if tier.lenders else
                                "take their MoE buffers beside the cache (--no-prefill-borrow)"))
    return {"expert_slots": tier.slots, "experts_cached": tier.cached(), "pcie_frac": pcie, "adapt_every": policy.every,
            "adapt_async": int(tier.copier is not None), "expert_profile": os.path.basename(args.expert_profile or "") or "-",
            "prefill_borrow": int(bool(tier.lenders)), "experts_mapped": int(not all(getattr(layer, "pinned", True)
                                                                                    for layer in tier.layers))}


def auto_cache(model: Model, reserve_mib: int, borrow: bool = True) -> list[int]:
    """`--expert-cache auto` on a GPU: each layer's slots, from what VRAM is free on its stage's device less
    the staging of that device's layers, the reserve and, without `borrow`, the MoE buffers of the
    largest prompt chunk (which borrow cache slots otherwise)."""
    h = model.hyper
    per_layer = slot_bytes(model.w.g, h.layers, h.experts)
    counts = [0] * h.layers
    buffers = 0 if borrow else outputs_bytes(model.kv.max_chunk * h.experts_used, expert_ffn(model.w.g), h.hidden,
                                             model.dtype)
    for device in model.placement.devices():
        layers = model.placement.layers_on(device)
        free, _ = free_bytes(device)
        staging = staging_bytes([per_layer[i] for i in layers], staging_entries(h.experts, h.experts_used))
        each = auto_slots(free - staging - buffers, reserve_mib, [per_layer[i] for i in layers], h.experts)
        for i in layers:
            counts[i] = each
        kept = f", a prompt chunk's MoE buffers ({buffers / MIB:.0f} MiB)" if buffers else ""
        log(f"--expert-cache auto: {each} slots in each of layers {layers[0]}-{layers[-1]} on {device}: "
            f"{free / MIB:.0f} MiB free less the misses' staging ({staging / MIB:.0f} MiB){kept} and the "
            f"{reserve_mib} MiB reserve")
    return counts


def choose_pcie(tier: Tier, asked: float, placement: Placement) -> float:
    """The GPU tier's share of misses read over PCIe: as asked, or measured (-1); prompt chunks stream their
    misses over PCIe unless the GPU cannot read host memory here."""
    from engine.tier.gpu_experts import measure_pcie_frac  # imports Triton

    uncached = [layer.slots.experts - layer.slots.cached() for layer in tier.layers]
    most = max(range(len(uncached)), key=uncached.__getitem__)
    if not uncached[most]:  # every expert cached: no misses to share
        share, why = max(asked, 0.0), "every expert is cached; not measured"
    else:
        with placement.stage_of(most).active():  # Triton launches on the current device
            tier.miss_times = measure_pcie_frac(tier.layers[most])
        share, why = tier.miss_times.share, tier.miss_times.text
        if tier.miss_times.pcie_us is None:  # the GPU cannot read host memory: every miss on the CPU
            for layer in tier.layers:
                layer.streams = False
        elif asked >= 0:
            share, why = asked, "as asked"
    for layer in tier.layers:
        layer.pcie_frac = share
    log(f"--pcie-frac {asked:g}: {share:g} ({why})")
    return share


def finish_tier(args: argparse.Namespace, model: Model, served: ExpertStats) -> None:
    """At quit: the decode hit rate of the tier (`served`: the decode windows' entries) and the routing profile."""
    tier = model.tier
    if tier is None:
        return
    tier.settle()
    log(f"decode expert cache hit rate: {served.vram / max(served.lookups, 1):.1%} ({served.vram} hits / "
        f"{served.lookups} lookups); {tier.swaps} swaps in {tier.rounds} rounds")
    if args.expert_profile_save:
        tier.profile(os.path.basename(args.model)).save(args.expert_profile_save)
        log(f"routing profile written to {args.expert_profile_save}")
