"""`strata-desk bench-engine --model X.gguf`: load time, prefill and decode speed, next to the bound.

The bound is the device's measured copy bandwidth divided by the bytes one decoded token reads
(the dense weights, the head, and `experts_used` of every layer's routed experts; the KV is left
out, so at short contexts the bound is tight).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from statistics import median

import torch

from engine import dense_copies
from engine.batch import Span
from engine.experts import ExpertStats
from engine.gguf_file import GGUFFile
from engine.host_allocator import keep_freed_blocks
from engine.kernels import cpu as cpu_kernels
from engine.kv import KV_DTYPES
from engine.loading import DTYPES, open_model, placement_of
from engine.memory import MIB
from engine.models.base import Model
from engine.prefill import PrefillAsk, choose_prefill, prefill_flag
from engine.protocol import Sampling
from engine.runner import AHEAD, Row, Runner
from engine.tier.flags import add_tier_flags, finish_tier, plan_tier, setup_tier

GB = 1e9
PROFILED_WINDOWS = 3  # decode windows `--profile` runs eagerly (each launching its kernels), per row count


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def timed(device: torch.device, work: Callable[[], object]) -> float:
    """Seconds `work()` takes, the device's queue drained before and after."""
    sync(device)
    t0 = time.perf_counter()
    work()
    sync(device)
    return time.perf_counter() - t0


@dataclass
class Figures:
    prefill_tok_s: float
    decode_tok_s: float
    batch_tok_s: float | None
    runner: Runner  # kept for --profile, with its sessions at the end of the run
    solo_row: Row
    batch_rows: list[Row]
    served: ExpertStats  # routed entries of the timed one-row decode, by where they were served
    swaps: int  # experts the tier copied into its slots during the timed one-row decode
    replay_ms: float | None  # a one-row window's CUDA graph replayed alone (None: no graph)
    prefill_peak: int | None  # VRAM bytes the timed prompt read took at its peak, over what it found (CUDA)
    batch_experts: float | None  # distinct experts a layer the batch rows routed, counted in one window after


class _Routed:
    """A layer's `Experts`, noting the distinct experts of each call (`experts_a_window`)."""

    def __init__(self, experts: object, seen: list[int]):
        self.experts, self.seen = experts, seen

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, **kwargs: object) -> torch.Tensor:
        self.seen.append(int(ids.unique().numel()))
        return self.experts(x, weights, ids, **kwargs)

    def __getattr__(self, name: str) -> object:
        return getattr(self.experts, name)


def experts_a_window(runner: Runner, rows: list[Row]) -> tuple[float | None, list[Row]]:
    """The distinct experts a layer one more window of `rows` routes (the mean over the layers), counted on
    an eager run of it, and the rows of the window after; None for a dense model or an expert tier (its own
    `Experts` stand in the layers)."""
    model = runner.model
    if not model.hyper.experts or model.tier is not None:
        return None, rows
    seen: list[int] = []
    layers = [b for b in model.blk if hasattr(b, "experts")]
    graphs, plans = runner.graphs, runner.plans
    runner.graphs = runner.plans = None  # a replay would not call the layers' Python
    for b in layers:
        b.experts = _Routed(b.experts, seen)
    try:
        tokens = runner.decode(rows)
    finally:
        for b in layers:
            b.experts = b.experts.experts
        runner.graphs, runner.plans = graphs, plans
    return sum(seen) / len(seen), [Row(r.session, t, r.sampling, r.seed) for r, t in zip(rows, tokens, strict=True)]


def decode_steps(runner: Runner, rows: list[Row], steps: int) -> list[Row]:
    """`steps` decode windows of `rows`, as the engine's loop runs them: each queued on the last one's
    tokens before the host reads them where the runner can (`Runner.can_queue_ahead`). Returns the rows of
    the next window."""
    if not runner.can_queue_ahead(rows):
        for _ in range(steps):
            tokens = runner.decode_window(rows)[0]
            rows = [Row(r.session, t, r.sampling, r.seed) for r, t in zip(rows, tokens, strict=True)]
        return rows
    window = runner.queue(rows)
    for step in range(steps):
        ahead = None
        if step + 1 < steps:
            ahead = runner.queue([Row(r.session, AHEAD, r.sampling, r.seed) for r in rows], after=window)
        tokens = window.tokens()
        runner.finish(window)
        if ahead is not None:
            for r, t in zip(rows, tokens, strict=True):
                r.session.tokens.append(t)  # the window queued ahead fed it
        rows = [Row(r.session, t, r.sampling, r.seed) for r, t in zip(rows, tokens, strict=True)]
        window = ahead
    return rows


def run(model: Model, device: torch.device, prompt_len: int, decode: int, slots: int, chunk: int, warmup: int = 3,
        graphs: bool = True, ahead: bool | None = None, distinct: bool = False, plans: bool = True) -> Figures:
    """`distinct`: the batch rows read prompts of their own instead of copying the one-row session."""
    runner = Runner(model, slots, exact=False, graphs=graphs, ahead=ahead, plans=plans)
    runner.chunk = chunk
    vocab = model.hyper.vocab

    def prompt_of(n: int) -> list[int]:
        return [(i * 7919 + n * 104729) % (vocab - 1) + 1 for i in range(prompt_len)]

    prompt = prompt_of(0)
    greedy = Sampling()
    state = {"token": 0}

    def read() -> None:
        state["token"] = int(runner.read(runner.solo, prompt).argmax())

    def one_row(steps: int) -> None:
        state["token"] = decode_steps(runner, [Row(runner.solo, state["token"], greedy, 0)], steps)[0].token

    read()  # warm-up, as llama-bench does: the first read also pays one-off costs (page faults, plans)
    runner.solo.tokens = []
    peak_from = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        peak_from = torch.cuda.memory_allocated(device)
    prefill_s = timed(device, read)
    prefill_peak = None if peak_from is None else torch.cuda.max_memory_allocated(device) - peak_from
    one_row(warmup)  # warm-up (and, with an expert tier, its first rounds)
    def swaps_so_far() -> int:
        return model.tier.swaps if model.tier is not None else 0

    before, swaps_before = model.expert_stats(), swaps_so_far()
    decode_s = timed(device, lambda: one_row(decode))
    served, swaps = model.expert_stats() - before, swaps_so_far() - swaps_before
    replay_ms = None
    if runner.graphs is not None and model.tier is None:  # the last window again (a tier would count it)
        last = len(runner.solo.tokens) - 1
        replay_ms = runner.graphs.replay_ms(runner.batches.build([Span(runner.solo.index, last, 1)],
                                                                 [runner.solo.tokens[last]]))
    rows: list[Row] = []
    batch_tok_s = batch_experts = None
    if slots >= 2:
        for n, s in enumerate(runner.sessions[:slots], start=1):
            if distinct:
                rows.append(Row(s, int(runner.read(s, prompt_of(n)).argmax()), greedy, 0))
            else:
                runner.copy(runner.solo, s)
                rows.append(Row(s, state["token"], greedy, 0))

        def steps(windows: int) -> None:
            nonlocal rows
            rows = decode_steps(runner, rows, windows)

        steps(warmup)
        batch_tok_s = slots * decode / timed(device, lambda: steps(decode))
        batch_experts, rows = experts_a_window(runner, rows)
    solo = Row(runner.solo, state["token"], greedy, 0)
    return Figures(prompt_len / prefill_s, decode / decode_s, batch_tok_s, runner, solo, rows, served, swaps, replay_ms,
                   prefill_peak, batch_experts)


def handoff_us(model: Model, rows: int, reps: int = 100) -> float:
    """Microseconds one hand-off of `rows` hidden rows takes from the first stage to the second, waited
    for (the most it can cost a token; in a pipeline it overlaps other work)."""
    src, dst = model.placement.stages[:2]
    x = torch.zeros(rows, model.hyper.hidden, dtype=model.dtype, device=src.device)
    sync(src.device)
    t0 = time.perf_counter()
    for _ in range(reps):
        model.handoff.move(x, src, dst)
        sync(dst.device)
    return (time.perf_counter() - t0) / reps * 1e6


@dataclass
class Peer:
    """llama.cpp's figures on the same file, from its `llama-bench` (JSON output)."""

    prefill_tok_s: float
    decode_tok_s: float
    build: str


class PeerFailed(RuntimeError):
    """llama-bench did not run or gave no figures: the message says how."""


def llama_bench(binary: str, model: str, threads: int, prompt: int, decode: int, reps: int = 5,
                extra: tuple[str, ...] = ()) -> Peer:
    cmd = [binary, "-m", model, "-t", str(threads), "-p", str(prompt), "-n", str(decode), "-r", str(reps), *extra,
           "-o", "json"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PeerFailed(f"{shlex.join(cmd)}: {exc}") from exc
    if out.returncode != 0:
        how = (f"killed by {signal.Signals(-out.returncode).name}" if out.returncode < 0 and
               -out.returncode in signal.valid_signals() else f"exit code {out.returncode}")
        tail = out.stderr.strip()[-300:]
        raise PeerFailed(f"{shlex.join(cmd)} failed ({how}){': ' + tail if tail else ''}")
    try:
        rows = json.loads(out.stdout)
        prefill = next(r for r in rows if r["n_prompt"] and not r["n_gen"])
        gen = next(r for r in rows if r["n_gen"] and not r["n_prompt"])
    except (ValueError, KeyError, TypeError, StopIteration) as exc:
        raise PeerFailed(f"{shlex.join(cmd)} printed no prompt and decode figures ({exc!r})") from exc
    return Peer(prefill["avg_ts"], gen["avg_ts"], f"{prefill.get('build_commit', '?')} ({prefill.get('backends', '?')})")


def spread(values: list[float]) -> str:
    """`12.3 tok/s`, or over several rounds their median with the lowest and highest."""
    if len(values) == 1:
        return f"{values[0]:.1f} tok/s"
    return f"{median(values):.1f} tok/s (median of {len(values)} rounds, {min(values):.1f}-{max(values):.1f})"


def profile(work: Callable[[], object], device: torch.device, windows: int = 1, per: str = "a window") -> str:
    """Where `work`'s time goes, per window (`work` runs `windows` of them): on CUDA each kernel's device time (the
    kernels only, so no time counts twice: an operator's time is its kernels'), on the CPU each operator's own."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch_profile(activities=activities) as prof:
        work()
        sync(device)
    times: dict[str, tuple[float, int]] = {}
    for e in prof.key_averages():
        if (e.device_type == DeviceType.CUDA) == cuda:
            name = kernel_name(e.key) if cuda else e.key
            us, calls = times.get(name, (0.0, 0))
            times[name] = (us + (e.self_device_time_total if cuda else e.self_cpu_time_total), calls + e.count)
    return profile_table([(name, us, calls) for name, (us, calls) in times.items()], windows,
                         "kernels" if cuda else "CPU operators", per)


def kernel_name(key: str) -> str:
    """A CUDA kernel's name as the profiler's table shows it: without `void`, template arguments and parameters
    (torch's and cuBLAS's run to hundreds of characters)."""
    return re.split(r"[<(]", key.removeprefix("void "), maxsplit=1)[0].strip() or key


def profile_table(times: list[tuple[str, float, int]], windows: int, what: str, per: str = "a window",
                  least: float = 0.005) -> str:
    """`profile`'s table from (name, microseconds, calls) over `windows` windows: per window (`per`), the largest
    first, each down to `least` of the total, the rest summed in one line."""
    total = sum(us for _, us, _ in times)
    if not total:
        return f"no {what} timed"
    lines = [f"{total / windows:.1f} us of {what} {per}", f"{'us ' + per:>14}  {'share':>6}  {'calls':>6}  name"]
    listed = [(name, us, calls) for name, us, calls in sorted(times, key=lambda t: -t[1]) if us >= least * total]
    for name, us, calls in listed:
        lines.append(f"{us / windows:14.1f}  {us / total:6.1%}  {calls / windows:6.1f}  {name}")
    rest = total - sum(us for _, us, _ in listed)
    if rest > 0:
        lines.append(f"{rest / windows:14.1f}  {rest / total:6.1%}  {'':6}  ({len(times) - len(listed)} others)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="strata-desk bench-engine", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", choices=tuple(DTYPES))
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens for the prefill figure (at most half "
                   "the context)")
    p.add_argument("--prefill", type=prefill_flag, default=PrefillAsk(512),
                   help="prompt chunk size in tokens or auto[:MAX], as the engine's")
    p.add_argument("--decode", type=int, default=64, help="tokens to decode")
    p.add_argument("--slots", type=int, default=8, help="also time a batch window of this many rows (0 = skip)")
    p.add_argument("--distinct", action="store_true", help="the batch rows read prompts of their own, as different "
                   "conversations (in a MoE they route more experts a layer: ~50 for 8 rows of qwen3-30b-a3b's 128) "
                   "instead of copies of the one-row session (the same experts as one row)")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--kv", choices=tuple(KV_DTYPES), help="KV storage, as the engine's --kv")
    p.add_argument("--profile", action="store_true",
                   help="print where one-row and batch windows and a prompt read spend time")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (default: torch's choice)")
    p.add_argument("--cpu-activations", choices=tuple(cpu_kernels.ACTIVATIONS), default="int16",
                   help="CPU decode products: int16, int8 or float32 activations")
    p.add_argument("--cuda-graphs", choices=("on", "off"), default="on", help="decode windows replayed from CUDA "
                   "graphs, as the engine's")
    p.add_argument("--cpu-plans", choices=("on", "off"), default="on", help="decode windows replayed from CPU "
                   "plans, as the engine's")
    p.add_argument("--ahead", choices=("on", "off"), default="on", help="decode windows queued on the last "
                   "one's tokens before the host reads them, as the engine's loop does (CUDA)")
    p.add_argument("--warmup", type=int, default=3, help="decode windows before the timed ones (an expert tier "
                   "adapts during them)")
    add_tier_flags(p)
    dense_copies.add_flag(p)
    p.add_argument("--layer-split", default="", help="as the engine's: '24', '12,24,36' or auto; also prints the "
                   "hand-off's cost between stages")
    p.add_argument("--llama-bench", metavar="PATH", help="also run llama.cpp's llama-bench on the same file and "
                   "print its figures beside ours")
    p.add_argument("--llama-bench-args", default="", metavar="ARGS",
                   help="more arguments for llama-bench, e.g. '--repack 0'")
    p.add_argument("--rounds", type=int, default=1, help="time prefill and decode this many times (with "
                   "--llama-bench: each round followed by one of llama.cpp's) and print the medians: on a shared "
                   "machine single runs of either move by 20%%")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu_kernels.set_activations(args.cpu_activations)
    keep_freed_blocks()

    t0 = time.perf_counter()
    g = GGUFFile(args.model)
    placement = placement_of(g, args.device, args.layer_split)
    plan = plan_tier(args, g, placement)
    g, model = open_model(args.model, args.device, args.dtype, args.slots, args.context, kv=args.kv,
                          layer_split=args.layer_split, host_experts=plan.host_experts,
                          max_chunk=args.prefill.most(placement.first.device))
    device, dtype = model.device, model.dtype
    sync(device)
    t1 = time.perf_counter()
    # before the tier's cache takes its VRAM (`--expert-cache auto`: all but the reserve)
    bw = copy_bandwidth(device, 1 << 30 if device.type == "cuda" else 256 << 20)
    t2 = time.perf_counter()
    setup_tier(args, model)
    sync(device)
    load_s = time.perf_counter() - t0 - (t2 - t1)
    per_token = model.bytes_per_token()
    rounds: list[Figures] = []
    peers: list[Peer] = []
    peer_failed: str | None = None
    peer_args = tuple(shlex.split(args.llama_bench_args))
    threads = torch.get_num_threads()
    prompt = min(args.prompt, args.context // 2)
    chunk, why = choose_prefill(Runner(model, 0, exact=False, graphs=False), args.prefill)
    copies = dense_copies.install(model, args.dense_copies, exact=False, tiles=args.dense_tiles)
    for _ in range(args.rounds):
        rounds.append(run(model, device, prompt, args.decode, args.slots, chunk, args.warmup,
                          graphs=args.cuda_graphs == "on", ahead=None if args.ahead == "on" else False,
                          distinct=args.distinct, plans=args.cpu_plans == "on"))
        if args.llama_bench and peer_failed is None:
            try:
                peers.append(llama_bench(args.llama_bench, args.model, threads, args.prompt, args.decode,
                                         reps=1 if args.rounds > 1 else 5, extra=peer_args))
            except PeerFailed as exc:  # our figures stand: print them, then say what failed
                peer_failed, peers = str(exc), []
    r = rounds[-1]
    prefill_tok_s = median(f.prefill_tok_s for f in rounds)
    decode_tok_s = median(f.decode_tok_s for f in rounds)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"model        {args.model} ({g.architecture}, {model.hyper.layers} layers, {dtype})")
    print(f"device       {device} {name}, {torch.get_num_threads()} CPU threads, torch {torch.__version__}")
    placed = sum(model.w.split().values())
    print(f"load         {load_s:.2f} s ({placed / GB:.2f} GB of weights placed: {placed / GB / load_s:.2f} GB/s)")
    if model.placement.split:
        stages = model.placement.stages
        rows = max(args.slots, 1)
        print(f"layer split  {model.placement.describe()}; hand-off {handoff_us(model, 1):.1f} us for one row, "
              f"{handoff_us(model, rows):.1f} us for {rows} rows ({model.hyper.hidden * dtype.itemsize} bytes a row), "
              f"{len(stages) - 1} per token")
    chunks = "one chunk" if prompt <= chunk else f"chunks of {chunk}"
    peak = "" if r.prefill_peak is None else f", {r.prefill_peak / MIB:.0f} MiB of VRAM at its peak"
    print(f"prefill      {spread([f.prefill_tok_s for f in rounds])} ({prompt} tokens, {chunks}{peak})")
    if args.prefill.auto:
        print(f"chunk        {why}")
    if copies is not None:
        print(f"copies       {copies}")
    print(f"decode       {spread([f.decode_tok_s for f in rounds])} (one row)")
    print(f"bytes/token  {per_token / GB:.3f} GB of weights read per decoded token")
    print(f"bandwidth    {bw / GB:.1f} GB/s measured (device copy)")
    bound = bw / per_token
    print(f"bound        {bound:.1f} tok/s  -> decode is {100 * decode_tok_s / bound:.1f}% of the bound")
    if r.runner.graphs is not None:
        graphs = r.runner.graphs
        print(f"cuda graphs  {graphs.captures} captured, {graphs.replays} windows replayed"
              + (f"; off: {graphs.failed}" if graphs.failed else "")
              + f"; {r.runner.queued_ahead} queued on the last one's tokens before the host read them")
        if r.replay_ms is not None:
            print(f"one row      {1000 / decode_tok_s:.3f} ms a window, {r.replay_ms:.3f} ms of it the graph's "
                  f"replay (the GPU's work; the rest is the host's)")
    if r.runner.plans is not None:
        plans = r.runner.plans
        print(f"cpu plans    {plans.captures} recorded, {plans.replays} windows replayed"
              + (f"; off: {plans.failed}" if plans.failed else ""))
    if model.tier is not None:
        s, tier = r.served, model.tier
        n = max(s.lookups, 1)
        print(f"tier         {tier.mode}: {tier.slots} slots for {tier.experts_total} experts "
              f"({tier.slots / tier.experts_total:.0%}); timed decode served {s.vram / n:.1%} from VRAM, "
              f"{s.pcie / n:.1%} over PCIe, {s.cpu / n:.1%} on the CPU; {tier.swaps} swaps in {tier.rounds} rounds, "
              f"{r.swaps / args.decode:.2f} a token in the timed decode")
        costs = tier.miss_times
        if costs is not None and costs.pcie_us is not None:
            miss_ms = (s.pcie * costs.pcie_us + s.cpu * costs.cpu_us) / args.decode / 1000
            # a blocking round's copies hold the next window up about as long as as many entries over PCIe
            swap_ms = 0.0 if tier.copier is not None else r.swaps * costs.pcie_us / args.decode / 1000
            print(f"misses       {miss_ms:.2f} ms a token predicted from their counts and the costs measured at "
                  f"start ({costs.pcie_us:.0f} us an entry over PCIe, {costs.cpu_us:.0f} us on the CPU), "
                  f"{swap_ms:.2f} ms for the blocking rounds' copies (an entry over PCIe each): with an "
                  f"all-resident step of T ms, 1000 / (T + {miss_ms + swap_ms:.2f}) tok/s")
        if tier.mode == "gpu":
            loans = [(lender.loans, lender.largest, lender.refilled) for lender in tier.lenders]
            print("borrow       " + (f"{sum(n for n, _, _ in loans)} loans of cache slots to prompt chunks, at most "
                                     f"{max(b for _, b, _ in loans) / MIB:.0f} MiB, {sum(c for _, _, c in loans) / MIB:.0f} "
                                     f"MiB of experts copied back" if loans else "off (--no-prefill-borrow)"))
    if r.batch_tok_s is not None:
        batch = [f.batch_tok_s for f in rounds if f.batch_tok_s is not None]
        kind = "different prompts" if args.distinct else "copies of the one-row session"
        print(f"batch        {spread(batch)} aggregate over {args.slots} rows, {kind} "
              f"({median(batch) / decode_tok_s:.2f}x one row)")
        if r.batch_experts is not None:
            batch_bound = args.slots * bw / model.bytes_per_window(r.batch_experts)
            print(f"batch bound  {batch_bound:.1f} tok/s for {args.slots} rows reading {r.batch_experts:.1f} distinct "
                  f"experts a layer (counted in one window; {batch_bound / bound:.2f}x one row's bound) -> "
                  f"{100 * median(batch) / batch_bound:.1f}% of it")
    if peers:
        peer_prefill, peer_decode = median(q.prefill_tok_s for q in peers), median(q.decode_tok_s for q in peers)
        print(f"llama.cpp    {peers[0].build}, {threads} threads: prefill {spread([q.prefill_tok_s for q in peers])}, "
              f"decode {spread([q.decode_tok_s for q in peers])}")
        print(f"ratio        prefill {prefill_tok_s / peer_prefill:.2f}x, decode {decode_tok_s / peer_decode:.2f}x "
              f"llama.cpp{' (medians of rounds run in turn)' if len(peers) > 1 else ''}")
    if peer_failed:
        print(f"llama.cpp    failed: {peer_failed}")
    if args.profile:
        runner = r.runner
        if runner.plans is not None:  # a replayed window is one C call: profile each call by name instead
            runner.plans = None
            print("\n(CPU plans off for the profile: its windows' C calls by name)")

        def windows(rows: list[Row]) -> Callable[[], None]:
            return lambda: [runner.decode(rows) for _ in range(PROFILED_WINDOWS)]

        print("\none row, per window:\n" + profile(windows([r.solo_row]), device, PROFILED_WINDOWS))
        if r.batch_rows:
            print(f"\n{args.slots} rows, per window:\n" + profile(windows(r.batch_rows), device, PROFILED_WINDOWS))
        tokens = runner.solo.tokens[:prompt]  # the bench's prompt, read again
        runner.solo.tokens = []
        read = profile(lambda: runner.read(runner.solo, tokens), device, per="the read")
        print(f"\nprompt ({len(tokens)} tokens):\n" + read)
    finish_tier(args, model, r.served)  # --expert-profile-save
    return 1 if peer_failed else 0


if __name__ == "__main__":
    sys.exit(main())
