"""`python -m server.bench_parking`: the first-token time of follow-ups, conversation parking on and off.

Two long conversations (A and B) take turns on a server with `--parallel` slots; after each round
`--parallel` other requests take every slot at once, so when a conversation's next turn comes its
slot holds someone else's. With parking on, the engine parked the conversation in host RAM when its
slot was taken and restores it for the follow-up, which reads only its new turn; off, the follow-up
reads its whole history again. For each arm it prints the first-token times of the first turns and
of the follow-ups (median, seconds), the prompt tokens the follow-ups reused (the usage's
`cached_tokens`), and the engine's parking figures from /metrics.

The issue's figure, 8K-token conversations on the demo model (the lead's run; minutes):

    python -m server.bench_parking --model PATH/gemma-3-270m-q4_k_m.gguf --tokens 8000 --context 16384

A quick check that it runs (HashLM, a model of under a millisecond a token): `--hashlm --tokens 300`.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from engine.hashlm import Rule, write_hashlm
from server.bench_overhead import ROOT, _free_port

CHAT = "/v1/chat/completions"


@dataclass
class Arm:
    name: str
    first: list[float] = field(default_factory=list)  # first-token seconds of the first turns
    follow: list[float] = field(default_factory=list)  # ... of the follow-ups
    prompt: list[int] = field(default_factory=list)  # prompt tokens of the follow-ups
    reused: list[int] = field(default_factory=list)  # of which reused
    parking: dict | None = None


def history(name: str, tokens: int) -> str:
    """About `tokens` tokens of distinct text for conversation `name` (about 10 tokens a line)."""
    lines = [f"{name} fact {i}: the value of {name}{i} is {(i * 7919) % 1009}." for i in range(max(1, tokens // 10))]
    return "Remember these facts, I will ask about them.\n" + "\n".join(lines)


def chat(client: httpx.Client, messages: list[dict], max_tokens: int) -> tuple[float, str, dict]:
    """One streamed chat: (seconds to the first content, the reply, the usage)."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, text, use = None, [], {}
    with client.stream("POST", CHAT, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read().decode()}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            use = chunk.get("usage") or use
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content") or choice.get("delta", {}).get("reasoning_content")
                if piece:
                    first = first if first is not None else time.perf_counter() - t0
                    text.append(piece)
    return (first if first is not None else time.perf_counter() - t0), "".join(text), use


def fill_slots(client: httpx.Client, n: int, round_: int, tokens: int, max_tokens: int) -> None:
    """`n` other requests at once: every slot is taken by someone else."""
    def one(i: int) -> None:
        chat(client, [{"role": "user", "content": history(f"other{round_}x{i}", tokens)}], max_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def run_arm(args: argparse.Namespace, model: Path, tmp: Path, mib: int) -> Arm:
    port = _free_port()
    cfg = {"model": str(model), "tokenizer": "bytes" if args.hashlm else "gguf", "device": args.device,
           "port": port, "parallel": args.parallel, "context": args.context, "prefill": args.prefill,
           "conversation_cache_mib": mib, "log": str(tmp / f"engine-{mib}.log")}
    path = tmp / f"strata-bench-parking-{mib}.json"
    path.write_text(json.dumps(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "server", "--config", str(path)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    arm = Arm("parking" if mib else "off")
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=3600) as client:
            _wait_ready(client, proc)
            chat(client, [{"role": "user", "content": "warm up"}], 4)
            convs = {name: [{"role": "user", "content": history(name, args.tokens)}] for name in ("A", "B")}
            for round_ in range(args.rounds + 1):
                for messages in convs.values():
                    ttft, reply, use = chat(client, messages, args.max_tokens)
                    if round_ == 0:
                        arm.first.append(ttft)
                    else:
                        arm.follow.append(ttft)
                        arm.prompt.append(use.get("prompt_tokens", 0))
                        arm.reused.append(use.get("prompt_tokens_details", {}).get("cached_tokens", 0))
                    messages += [{"role": "assistant", "content": reply},
                                 {"role": "user", "content": f"Question {round_ + 1}: what was fact {round_ + 1}?"}]
                fill_slots(client, args.parallel, round_, args.other_tokens, args.max_tokens)
            arm.parking = client.get("/metrics").json().get("parking")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return arm


def _wait_ready(client: httpx.Client, proc: subprocess.Popen, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the server exited before it was ready (see its engine log)")
        try:
            if client.get("/health").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the server did not get ready")


def report(arms: list[Arm]) -> str:
    out = [f"{'arm':<8} {'first turns s':>14} {'follow-ups s':>13} {'follow-up prompt':>17} {'reused':>8}  parking"]
    for a in arms:
        p = a.parking or {}
        figures = (f"restores {p.get('restores')}, restore ms {p.get('restore_ms_last')} last / "
                   f"{p.get('restore_ms_mean')} mean, parked {p.get('parked')} ({p.get('parked_mib')} MiB), "
                   f"hit rate {p.get('hit_rate')}") if p else "off"
        out.append(f"{a.name:<8} {statistics.median(a.first):>14.3f} {statistics.median(a.follow):>13.3f} "
                   f"{statistics.median(a.prompt):>17.0f} {statistics.median(a.reused):>8.0f}  {figures}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m server.bench_parking", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="GGUF file (e.g. the demo model)")
    p.add_argument("--hashlm", action="store_true", help="a HashLM test model instead (a quick check)")
    p.add_argument("--tokens", type=int, default=8000, help="tokens of each conversation's first turn")
    p.add_argument("--other-tokens", type=int, default=200, help="tokens of each other request")
    p.add_argument("--rounds", type=int, default=2, help="follow-ups per conversation")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per reply")
    p.add_argument("--parallel", type=int, default=4, help="batch slots (all taken by others between turns)")
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--mib", type=int, default=2048, help="conversation_cache_mib of the parking arm")
    args = p.parse_args(argv)
    if bool(args.model) == args.hashlm:
        p.error("give --model PATH or --hashlm")
    if args.rounds < 1 or args.tokens < 10 or args.parallel < 2:
        p.error("--rounds >= 1, --tokens >= 10 and --parallel >= 2")
    tmp = Path(tempfile.mkdtemp(prefix="strata-bench-parking-"))
    model = write_hashlm(tmp / "hashlm.gguf", Rule(ends=False)) if args.hashlm else Path(args.model)
    arms = [run_arm(args, model, tmp, mib) for mib in (args.mib, 0)]
    print(f"conversation parking: two conversations of {args.tokens} tokens taking turns, {args.parallel} slots "
          f"taken by others between turns ({model.name}, {args.device})")
    print(report(arms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
