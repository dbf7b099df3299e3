"""`python -m engine --serve --model X.gguf [options]`: load a model and speak the line protocol."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import torch

from engine import __version__
from engine import protocol as P
from engine.gguf_file import GGUFError, GGUFFile
from engine.kernels import cpu as cpu_kernels
from engine.kv import KV_DTYPES
from engine.loading import DTYPES, fit_slots, log, model_context, pick_device, pick_dtype, pick_kv_dtype
from engine.loop import EngineLoop
from engine.memory import MIB
from engine.models import architecture_of, load_model
from engine.models.base import Model
from engine.runner import Runner
from engine.stop_tokens import stop_token_ids
from engine.tier import FIXED, AdaptPolicy, RoutingProfile, TierError, install_tier, parse_expert_cache

# Accepted for upstream compatibility, not run (INFO `unsupported`): adapt_async runs blocking and
# pcie_frac is 0 on the simulated tier; the adapt options only tune a tier (--expert-cache).
UNSUPPORTED = ("batch_groups", "batch_mtp", "adapt_async", "pcie_frac")
TIER_ONLY = ("adapt_every", "adapt_swaps", "adapt_decay", "adapt_min_gain")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engine", description="strata-desk inference engine")
    p.add_argument("--serve", action="store_true", help="speak the line protocol on stdin/stdout")
    p.add_argument("--model", required=True, help="GGUF file")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", choices=tuple(DTYPES), help="weights dtype (default: f32 on CPU, bf16 on CUDA)")
    p.add_argument("--max-context", type=int, default=4096, help="context in tokens (at most the model's)")
    p.add_argument("--prefill", type=int, default=512, help="prompt chunk size in tokens")
    p.add_argument("--kv", choices=tuple(KV_DTYPES), help="KV storage (default: f16 on CPU, the weights dtype on CUDA)")
    p.add_argument("--batch", "--slots", dest="batch", type=int, default=0, help="batch slots (2..8)")
    p.add_argument("--exact", action="store_true", help="row-invariant windows: batch tokens equal solo tokens")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (default: torch's choice)")
    p.add_argument("--cpu-activations", choices=("int16", "float"), default="int16",
                   help="CPU decode products with quantized weights: activations rounded to int16 per 32 "
                        "values (faster) or float32 (the reference's arithmetic)")
    p.add_argument("--batch-groups", default="auto")
    p.add_argument("--batch-mtp", action="store_true")
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
    return p


def setup_tier(args: argparse.Namespace, model: Model) -> dict[str, int | float | str]:
    """Install the expert tier `--expert-cache` asks for; its INFO keys ({} when every expert stays resident)."""
    policy = AdaptPolicy(args.adapt_every, args.adapt_swaps, args.adapt_decay, args.adapt_min_gain)
    if not (0 <= args.pcie_frac <= 1 or args.pcie_frac == -1):
        raise TierError(f"--pcie-frac must be -1 or in [0, 1], got {args.pcie_frac}")
    cache = parse_expert_cache(args.expert_cache) if args.expert_cache is not None else None
    if cache is None or not model.hyper.experts:
        if args.expert_profile or args.expert_profile_save:
            raise TierError("--expert-profile/--expert-profile-save need an expert tier (--expert-cache on a MoE model)")
        return {}
    if cache == "auto":
        log("--expert-cache auto: no VRAM to size a cache from on the CPU; every expert stays resident "
            "(--expert-cache N runs the simulated tier)")
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


def main(argv: list[str] | None = None, make_runner: Callable[[Model, int, bool], Runner] = Runner,
         make_loop: Callable[..., EngineLoop] = EngineLoop) -> int:
    """Load, announce, serve. `make_runner`/`make_loop` build the Runner and the EngineLoop (the test
    harness, engine/harness.py, passes subclasses that add its switches)."""
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu_kernels.set_int16(args.cpu_activations == "int16")
    t0 = time.perf_counter()
    try:
        device = pick_device(args.device)
        dtype = pick_dtype(args.dtype, device)
        g = GGUFFile(args.model)
        architecture_of(g)
        context = model_context(g, args.max_context)
        kv_dtype = pick_kv_dtype(args.kv, device, dtype)
        slots = fit_slots(args.batch, g, context, dtype, device, args.prefill, kv_dtype)
        model = load_model(g, device, dtype, sessions=slots + 1, context=context, max_chunk=args.prefill,
                           kv_dtype=kv_dtype)
        tier_info = setup_tier(args, model)
    except (GGUFError, ValueError, RuntimeError, OSError) as exc:
        log(f"cannot load {args.model}: {exc}")
        print(P.format_reply(P.Err(f"cannot load model: {exc}")), flush=True)
        return 1
    load_s = time.perf_counter() - t0
    h = model.hyper
    kv_mib = model.kv.session_bytes() / MIB
    log(f"loaded {g.architecture} from {args.model} in {load_s:.1f} s on {device} ({dtype}); "
        f"{h.layers} layers, weights {model.w.bytes() / MIB:.0f} MiB ({model.w.describe()}), "
        f"{slots} batch slots, context {context}")
    if h.experts and not tier_info:
        log("expert tier: every expert resident in device memory; the adapt options have no effect")
    info: dict[str, int | float | str] = {
        "engine": __version__, "model": os.path.basename(args.model), "arch": g.architecture,
        "context": context, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
        "kv": str(kv_dtype).removeprefix("torch."), "cpu_activations": args.cpu_activations,
        "layers": h.layers, "experts": h.experts, "experts_used": h.experts_used,
        "weights_mib": round(model.w.bytes() / MIB), "kv_mib": round(kv_mib), "load_s": round(load_s, 2),
        "prefill": args.prefill, "exact": int(args.exact),
        "tier": (model.tier.mode if model.tier else "resident") if h.experts else "dense",
        "unsupported": ",".join(UNSUPPORTED + (() if model.tier else TIER_ONLY)), **tier_info,
    }
    if args.batch:
        info.update(batch_slots=slots, slot_cache=1, batch_groups=1)
    share = float(os.environ.get("STRATA_BATCH_DECODE_SHARE", "0.5"))
    loop = make_loop(make_runner(model, slots, args.exact), stop_token_ids(g.metadata), args.prefill, share)
    loop.emit(P.Info(info))
    loop.emit(P.Ready(context, stop=True))
    loop.start_reader(sys.stdin)
    loop.run()
    if model.tier is not None:
        served = loop.stats.experts
        log(f"decode expert cache hit rate: {served.vram / max(served.lookups, 1):.1%} ({served.vram} hits / "
            f"{served.lookups} lookups); {model.tier.swaps} swaps in {model.tier.rounds} rounds")
        if args.expert_profile_save:
            model.tier.profile(os.path.basename(args.model)).save(args.expert_profile_save)
            log(f"routing profile written to {args.expert_profile_save}")
    log("quit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
