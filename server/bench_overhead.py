"""`python -m server.bench_overhead`: what the HTTP server itself costs.

Starts `python -m server` over the real engine on a HashLM model (engine/hashlm.py: the real loop
and runner, a model of under a millisecond a token, replies that never end by themselves) running
as fast as it can, then measures with a minimal raw-socket SSE client:

- streamed tokens/s, sustained, for 1, 8 and 32 concurrent streams (8 batch slots for 8 and 32);
- what the server adds to a token of one stream: the time per token through HTTP minus the time per
  token straight from the engine's stdout (one long request each);
- the first-token latency the server adds: first token through HTTP minus first token straight from
  the engine's stdout (median of 30 short requests each).

Targets: the server adds at most 200 us a token (it could stream 5,000 tok/s) and < 5 ms to the first
token. Everything runs on this machine, so the client and the engine take CPU from the server too;
the figures are a lower bound.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from engine.hashlm import Rule, write_hashlm

ROOT = Path(__file__).resolve().parent.parent
TARGET_TOK_S = 5000.0
TARGET_TTFT_MS = 5.0
CONTEXT = 65536
_USAGE = re.compile(rb'"completion_tokens":(\d+)')
_TEXT = re.compile(rb'"text":"[^"]')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, parallel: int, model: Path, tmp: Path):
        self.port = _free_port()
        cfg = {"model": str(model), "tokenizer": "bytes", "device": "cpu", "port": self.port,
               "parallel": parallel, "context": CONTEXT, "queue_limit": 256, "log": str(tmp / "engine.log")}
        path = tmp / f"strata-bench-{self.port}.json"
        path.write_text(json.dumps(cfg))
        self.proc = subprocess.Popen([sys.executable, "-m", "server", "--config", str(path)], cwd=ROOT,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    async def wait(self) -> None:
        for _ in range(600):
            try:
                status, _ = await request(self.port, "GET", "/health", None)
                if status == 200:
                    return
            except OSError:
                pass
            await asyncio.sleep(0.05)
        raise RuntimeError("the server did not get ready")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def request(port: int, method: str, path: str, body: dict | None) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode() if body is not None else b""
    head = (f"{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode()
    writer.write(head + data)
    await writer.drain()
    raw = await reader.read()
    writer.close()
    status = int(raw.split(b" ", 2)[1])
    return status, raw


async def stream(port: int, prompt: str, max_tokens: int) -> tuple[int, float, float]:
    """(tokens, seconds to the first content byte, total seconds) of one streamed completion."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    data = json.dumps(body).encode()
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write((f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(data)}\r\n\r\n").encode() + data)
    await writer.drain()
    first = None
    tail = b""
    while True:
        chunk = await reader.read(65536)
        if not chunk:
            break
        if first is None and _TEXT.search(chunk):
            first = time.perf_counter() - t0
        tail = (tail + chunk)[-4096:]
        if b"data: [DONE]" in tail:
            break
    total = time.perf_counter() - t0
    writer.close()
    m = _USAGE.findall(tail)
    return (int(m[-1]) if m else 0), (first if first is not None else total), total


async def throughput(port: int, n: int, tokens_each: int) -> tuple[float, int, float]:
    t0 = time.perf_counter()
    res = await asyncio.gather(*(stream(port, f"stream {i} says", tokens_each) for i in range(n)))
    wall = time.perf_counter() - t0
    total = sum(r[0] for r in res)
    return total / wall, total, wall


async def server_ttft(port: int, rounds: int) -> list[float]:
    out = []
    for i in range(rounds):
        _, first, _ = await stream(port, f"latency probe {i}", 4)
        out.append(first * 1000)
    return out


def _gen(p: subprocess.Popen, prompt: str, max_new: int) -> tuple[float, float, int]:
    """One GEN straight to the engine: (ms to the first token, seconds in all, tokens)."""
    assert p.stdin is not None and p.stdout is not None
    ids = ",".join(str(b) for b in prompt.encode())
    t0 = time.perf_counter()
    p.stdin.write(f"GEN {max_new} {ids}\n")
    p.stdin.flush()
    first, tokens = None, 0
    while not (line := p.stdout.readline()).startswith("DONE"):
        if line.startswith("T "):
            tokens += 1
            first = first or (time.perf_counter() - t0) * 1000
    return first or 0.0, time.perf_counter() - t0, tokens


def engine_direct(model: Path, rounds: int, tokens: int) -> tuple[list[float], float]:
    """Straight from the engine's stdout (no server): the first-token ms of `rounds` short requests,
    and the tok/s of one request of `tokens` tokens."""
    p = subprocess.Popen([sys.executable, "-m", "engine", "--serve", "--model", str(model), "--device", "cpu",
                          "--max-context", str(CONTEXT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True, bufsize=1)
    assert p.stdin is not None and p.stdout is not None
    while not p.stdout.readline().startswith("READY"):
        pass
    _gen(p, "warm up", 50)
    ttft = [_gen(p, f"latency probe {i}", 4)[0] for i in range(rounds)]
    _, seconds, n = _gen(p, "stream 0 says", tokens)
    p.stdin.write("QUIT\n")
    p.stdin.close()
    p.wait(5)
    return ttft, n / seconds


async def main_async(args: argparse.Namespace) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="strata-bench-"))
    model = write_hashlm(tmp / "hashlm.gguf", Rule(ends=False))
    results: dict[int, tuple[float, int, float]] = {}
    ttft: list[float] = []
    for n, parallel in ((1, 1), (8, 8), (32, 8)):
        srv = Server(parallel, model, tmp)
        try:
            await srv.wait()
            await throughput(srv.port, min(n, 4), 50)  # warm up
            each = max(200, int(args.tokens / n))
            results[n] = await throughput(srv.port, n, each)
            if n == 1:
                ttft = await server_ttft(srv.port, args.rounds)
        finally:
            srv.stop()
    direct, engine_tok_s = engine_direct(model, args.rounds, results[1][1])
    print("strata-desk server overhead (the real engine on a HashLM model at full speed, everything on this machine)")
    print(f"{'streams':>8} {'slots':>6} {'tokens':>8} {'seconds':>8} {'tok/s total':>12}")
    for n, (rate, total, wall) in results.items():
        print(f"{n:>8} {1 if n == 1 else 8:>6} {total:>8} {wall:>8.2f} {rate:>12,.0f}")
    added_us = 1e6 / results[1][0] - 1e6 / engine_tok_s
    target_us = 1e6 / TARGET_TOK_S
    mark = "ok" if added_us <= target_us else "ABOVE"
    ok = added_us <= target_us
    print(f"one stream: {engine_tok_s:,.0f} tok/s straight from the engine -> the server adds {added_us:.0f} us "
          f"a token   target <= {target_us:.0f} us ({TARGET_TOK_S:,.0f} tok/s)  {mark}")
    s_med, e_med = statistics.median(ttft), statistics.median(direct)
    added = s_med - e_med
    mark = "ok" if added < TARGET_TTFT_MS else "ABOVE"
    ok &= added < TARGET_TTFT_MS
    print(f"first token: through the server {s_med:.2f} ms (median of {len(ttft)}), straight from the engine "
          f"{e_med:.2f} ms -> the server adds {added:.2f} ms   target < {TARGET_TTFT_MS:g} ms  {mark}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m server.bench_overhead", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=30000, help="tokens per measurement, split over the streams")
    p.add_argument("--rounds", type=int, default=30, help="first-token probes")
    return asyncio.run(main_async(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
