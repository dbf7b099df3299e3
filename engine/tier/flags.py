"""The expert tier's engine flags (`add_tier_flags`), setting the tier up from them (`setup_tier`) and
its closing lines and profile (`finish_tier`)."""

from __future__ import annotations

import argparse
import os

from engine.experts import ExpertStats
from engine.loading import log
from engine.memory import MIB
from engine.models.base import Model
from engine.tier import FIXED, AdaptPolicy, RoutingProfile, TierError, install_tier, parse_expert_cache


def add_tier_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--expert-cache", help="expert tier: 'auto' or N cache slots in all (spread over the layers); "
                                          "without it every expert is resident")
    p.add_argument("--expert-profile", help="routing profile (JSON) that seeds the expert cache")
    p.add_argument("--expert-profile-save", help="write the routing counts to this file when the engine quits")
    p.add_argument("--adapt-every", type=int, default=4, help=f"windows between re-ranks; 0 = static, {FIXED} = fixed")
    p.add_argument("--adapt-swaps", type=int, default=96, help="most experts swapped in per re-rank")
    p.add_argument("--adapt-decay", type=float, default=0.7, help="routing counts multiplied by this after a re-rank")
    p.add_argument("--adapt-min-gain", type=float, default=1.5, help="count ratio a swap must clear")
    p.add_argument("--adapt-async", type=int, default=0, choices=(0, 1))
    p.add_argument("--pcie-frac", type=float, default=-1.0, help="share of misses read over PCIe (-1: engine's choice)")


def setup_tier(args: argparse.Namespace, model: Model) -> dict[str, int | float | str]:
    """Install the expert tier `--expert-cache` asks for; its INFO keys ({} when every expert stays resident)."""
    policy = AdaptPolicy(args.adapt_every, args.adapt_swaps, args.adapt_decay, args.adapt_min_gain)
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
    if cache == "auto":
        why = ("the tier's GPU part is not built yet" if model.device.type == "cuda"
               else "no VRAM to size a cache from on the CPU (--expert-cache N runs the simulated tier)")
        log(f"--expert-cache auto: every expert stays resident: {why}")
        return {}
    save_dir = os.path.dirname(args.expert_profile_save or "") or "."
    if args.expert_profile_save and not os.path.isdir(save_dir):
        raise TierError(f"--expert-profile-save {args.expert_profile_save}: no directory {save_dir}")
    h = model.hyper
    if cache > h.layers * h.experts:
        log(f"--expert-cache {cache}: the model has {h.layers * h.experts} routed experts; caching all of them")
    profile = RoutingProfile.load(args.expert_profile) if args.expert_profile else None
    tier = install_tier(model, min(cache, h.layers * h.experts), policy, profile)
    if args.pcie_frac > 0:
        log(f"--pcie-frac {args.pcie_frac:g}: the simulated tier has no PCIe link; misses run on the CPU (pcie_frac=0)")
    if args.adapt_async:
        log("--adapt-async 1: the simulated tier has no copy stream; rounds run blocking before the next window")
    mode = "static" if policy.every == 0 else "fixed" if not policy.adapts else f"every {policy.every} windows"
    log(f"expert tier (simulated: slots in host RAM, cached experts and misses on the CPU): {tier.slots} slots "
        f"for {tier.experts_total} experts ({tier.slots / tier.experts_total:.0%}, {tier.cache_bytes() / MIB:.1f} MiB), "
        f"seeded {'from ' + args.expert_profile if profile else 'from the first windows'}, adaptation {mode}")
    return {"expert_slots": tier.slots, "experts_cached": tier.cached(), "pcie_frac": 0, "adapt_every": policy.every,
            "adapt_async": 0, "expert_profile": os.path.basename(args.expert_profile or "") or "-"}


def finish_tier(args: argparse.Namespace, model: Model, served: ExpertStats) -> None:
    """At quit: the decode hit rate of the tier (`served`: the decode windows' entries) and the routing profile."""
    tier = model.tier
    if tier is None:
        return
    log(f"decode expert cache hit rate: {served.vram / max(served.lookups, 1):.1%} ({served.vram} hits / "
        f"{served.lookups} lookups); {tier.swaps} swaps in {tier.rounds} rounds")
    if args.expert_profile_save:
        tier.profile(os.path.basename(args.model)).save(args.expert_profile_save)
        log(f"routing profile written to {args.expert_profile_save}")
