"""`python -m engine --serve --model X.gguf [options]`: load a model and speak the line protocol."""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Callable

import torch

from engine import __version__, dense_copies, warmup
from engine import protocol as P
from engine.gguf_file import GGUFError, GGUFFile
from engine.host_allocator import keep_freed_blocks
from engine.hyper import Hyper
from engine.kernels import cpu as cpu_kernels
from engine.kv import KV_DTYPES, kv_name
from engine.loading import DTYPES, fit_slots, log, model_context, pick_device, pick_dtype, pick_kv_dtype
from engine.loop import EngineLoop
from engine.memory import MIB
from engine.models import architecture_of, load_model
from engine.models.base import Model
from engine.parking import ParkingStore
from engine.placement import plan_groups, plan_stages
from engine.prefill import PrefillAsk, choose_prefill, prefill_flag
from engine.runner import Runner
from engine.stop_tokens import stop_token_ids
from engine.tier.flags import add_tier_flags, finish_tier, plan_tier, setup_tier

# Metadata key of the generated test models (strata_desk/testmodel.py): random weights, meaningless text.
GENERATED_KEY = "strata.test_model.seed"
# Accepted for upstream compatibility, not run (INFO `unsupported`); the adapt options only tune a tier
# (--expert-cache), pcie_frac, prefill_borrow and mmap_experts only the GPU tier.
UNSUPPORTED = ("batch_mtp",)
TIER_ONLY = ("adapt_every", "adapt_swaps", "adapt_decay", "adapt_min_gain", "adapt_min_count", "adapt_async")
GPU_TIER_ONLY = ("pcie_frac", "prefill_borrow", "mmap_experts")


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (got {value})")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engine", description="strata-desk inference engine")
    p.add_argument("--serve", action="store_true", help="speak the line protocol on stdin/stdout")
    p.add_argument("--model", required=True, help="GGUF file")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", choices=tuple(DTYPES), help="weights dtype (default: f32 on CPU, bf16 on CUDA)")
    p.add_argument("--max-context", type=int, default=4096, help="context in tokens (at most the model's)")
    p.add_argument("--prefill", type=prefill_flag, default=PrefillAsk(512),
                   help="prompt chunk size in tokens, or auto[:MAX]: the largest up to MAX (8192) whose "
                        "buffers fit in the VRAM left (measured at start; 512 on the CPU)")
    p.add_argument("--kv", choices=tuple(KV_DTYPES), help="KV storage (default: f16 on CPU, the weights dtype on CUDA)")
    p.add_argument("--batch", "--slots", dest="batch", type=int, default=0, help="batch slots (2..8)")
    p.add_argument("--exact", action="store_true", help="row-invariant windows: batch tokens equal solo tokens")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (default: torch's choice)")
    p.add_argument("--cpu-activations", choices=tuple(cpu_kernels.ACTIVATIONS), default="int16",
                   help="CPU decode products with quantized weights: activations rounded to int16 per 32 "
                        "values, 256 for Q4_K/Q5_K/Q6_K (faster); int8 as llama.cpp rounds them (fastest, "
                        "logits move more); or float32 (the reference's arithmetic)")
    p.add_argument("--cuda-graphs", choices=("on", "off"), default="on",
                   help="replay decode windows from CUDA graphs (one launch a window; CUDA, no layer split)")
    p.add_argument("--cpu-plans", choices=("on", "off"), default="on",
                   help="replay decode windows from CPU plans (the step's kernel calls in one; CPU, no expert cache)")
    p.add_argument("--batch-groups", default="auto",
                   help="the slots in G pipeline groups, G dividing the slots; auto: one group per stage")
    p.add_argument("--batch-mtp", action="store_true")
    add_tier_flags(p)
    dense_copies.add_flag(p)
    p.add_argument("--layer-split", default="",
                   help="the first layer of each later stage ('24', '12,24,36'), or auto (every visible GPU); "
                        "stage k on cuda:k, or every stage on the CPU with --device cpu")
    p.add_argument("--trim-stage-weights", action="store_true",
                   help="each stage holds only its own layers' weights (always so here: accepted for upstream)")
    p.add_argument("--conversation-cache-mib", type=_non_negative, default=P.CONVERSATION_CACHE_MIB,
                   help="host RAM for parked conversations, MiB (0 = off)")
    p.add_argument("--conversation-cache-slots", type=_non_negative, default=P.CONVERSATION_CACHE_SLOTS,
                   help="most conversations parked (0 = off)")
    return p


def placed_text(model: Model) -> str:
    """`1234 MiB on cuda, 16100 MiB on cpu`: the weights' bytes per device."""
    return ", ".join(f"{n / MIB:.0f} MiB on {device}" for device, n in model.w.split().items())


def unsupported_by_tier(model: Model) -> tuple[str, ...]:
    if model.tier is None:
        return TIER_ONLY + GPU_TIER_ONLY
    return () if model.tier.mode == "gpu" else GPU_TIER_ONLY


def main(argv: list[str] | None = None, make_runner: Callable[..., Runner] = Runner,
         make_loop: Callable[..., EngineLoop] = EngineLoop) -> int:
    """Load, announce, serve. `make_runner`/`make_loop` build the Runner and the EngineLoop (the test
    harness, engine/harness.py, passes subclasses that add its switches)."""
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu_kernels.set_activations(args.cpu_activations)
    keep_freed_blocks()
    t0 = time.perf_counter()
    try:
        device = pick_device(args.device)
        dtype = pick_dtype(args.dtype, device)
        g = GGUFFile(args.model)
        architecture_of(g)
        context = model_context(g, args.max_context)
        kv_dtype = pick_kv_dtype(args.kv, device, dtype)
        placement = plan_stages(args.layer_split, Hyper.from_gguf(g).layers, device)
        plan = plan_tier(args, g, placement)
        slots = fit_slots(args.batch, g, context, dtype, device, args.prefill.most(device), kv_dtype, placement,
                          plan.host_experts, plan.taken)
        groups, groups_note = plan_groups(args.batch_groups, slots, len(placement.stages))
        model = load_model(g, device, dtype, sessions=slots + 1, context=context, max_chunk=args.prefill.most(device),
                           kv_dtype=kv_dtype, placement=placement, host_experts=plan.host_experts)
        tier_info = setup_tier(args, model)
    except (GGUFError, ValueError, RuntimeError, OSError) as exc:
        log(f"cannot load {args.model}: {exc}")
        print(P.format_reply(P.Err(f"cannot load model: {exc}")), flush=True)
        return 1
    load_s = time.perf_counter() - t0
    h = model.hyper
    kv_mib = model.kv.session_bytes() / MIB
    log(f"loaded {g.architecture} from {args.model} in {load_s:.1f} s on {device} ({dtype}); "
        f"{h.layers} layers, weights {placed_text(model)} ({model.w.describe()}), "
        f"{slots} batch slots, context {context}")
    stage_mib = [model.w.bytes(lambda name, s=s: placement.tensor_stage(name) is s) / MIB for s in placement.stages]
    if placement.split:
        log("layer split: " + ", ".join(f"stage {s.index}: layers {s.label()}, weights {mib:.0f} MiB"
                                         for s, mib in zip(placement.stages, stage_mib, strict=True)))
    elif args.layer_split:
        log(f"--layer-split {args.layer_split}: one device ({device}), every layer on it")
    if args.trim_stage_weights:
        log("--trim-stage-weights: each stage already holds only its own layers' weights")
    if groups_note:
        log(groups_note)
    if h.experts and not tier_info:
        log("expert tier: every expert resident in device memory; the adapt options have no effect")
    info: dict[str, int | float | str] = {
        "engine": __version__, "model": os.path.basename(args.model), "arch": g.architecture,
        "context": context, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
        "kv": kv_name(kv_dtype), "cpu_activations": args.cpu_activations,
        "layers": h.layers, "experts": h.experts, "experts_used": h.experts_used,
        "weights_mib": round(sum(model.w.split().get(str(d), 0) for d in placement.devices()) / MIB), "kv_mib": round(kv_mib), "load_s": round(load_s, 2),
        "exact": int(args.exact),
        "tier": (model.tier.mode if model.tier else "resident") if h.experts else "dense",
        "unsupported": ",".join(UNSUPPORTED + unsupported_by_tier(model)), **tier_info,
        "generated": int(GENERATED_KEY in g.metadata),
        "layer_split": placement.describe() if placement.split else "-",
        "stage_weights_mib": ",".join(f"{mib:.0f}" for mib in stage_mib) if placement.split else "-",
        "conversation_cache_mib": args.conversation_cache_mib, "conversation_cache_slots": args.conversation_cache_slots,
    }
    if plan.host_experts:
        info["host_experts_mib"] = round(model.w.split().get("cpu", 0) / MIB)
    if args.batch:
        info.update(batch_slots=slots, slot_cache=1, batch_groups=groups)
    share = float(os.environ.get("STRATA_BATCH_DECODE_SHARE", "0.5"))
    parking = ParkingStore(args.conversation_cache_mib * MIB, args.conversation_cache_slots, pin=device.type == "cuda")
    runner = make_runner(model, slots, args.exact, groups, graphs=args.cuda_graphs == "on",
                         plans=args.cpu_plans == "on")
    info["cuda_graphs"] = "on" if runner.graphs is not None else "off"
    info["cpu_plans"] = "on" if runner.plans is not None else "off"
    try:
        runner.chunk, why = choose_prefill(runner, args.prefill)
        if args.prefill.auto:
            log(why)
        if (copies := dense_copies.install(model, args.dense_copies, args.exact, args.dense_tiles)) is not None:
            log(copies)
            info["dense_copies_mib"] = round(sum(model.copy_bytes.values()) / MIB)
        if warmup.needed(runner):
            log("warming up the GPU kernels: the first start after an install compiles them (a minute or two)")
            log(f"GPU kernels warmed in {warmup.warm_up(runner):.1f} s (compiled on a first start, from Triton's "
                f"cache after)")
    except RuntimeError as exc:  # `auto`'s measuring reads (running out of memory is handled there) or the warm-up failed
        log(f"cannot read a prompt chunk: {exc}")
        print(P.format_reply(P.Err(f"cannot read a prompt chunk: {exc}")), flush=True)
        return 1
    info["prefill"] = runner.chunk
    loop = make_loop(runner, stop_token_ids(g.metadata), runner.chunk, share,
                     parking=parking if parking.enabled else None)
    # what loading and the warm-up made lives as long as the engine: kept out of the collector's passes while it serves
    # (a full pass over a loaded engine's ~180,000 objects took 144-157 ms on a 2-core CPU, in the middle of whatever
    # ran then); handed back at the end, for a caller that runs the engine in its own process (tests)
    gc.collect()
    gc.freeze()
    try:
        loop.emit(P.Info(info))
        loop.emit(P.Ready(context, stop=True))
        loop.start_reader(sys.stdin)
        loop.run()
    finally:
        gc.unfreeze()
    finish_tier(args, model, loop.stats.experts)
    log("quit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
