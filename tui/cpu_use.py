"""`python -m tui.cpu_use`: how much CPU the dashboard process uses, idle and while requests run.

The dashboard runs as a user runs it: its own process, its real terminal driver, in a pseudo
terminal of `--size` columns x rows (this process reads and drops what it draws), managing a
running server. Without `--url`, a server of a generated HashLM model on the real engine (paced to
25 decode steps a second by engine/harness.py) is started in a temporary strata-desk home and
stopped at the end; with `--url`, the dashboard attaches to that server instead. The figure is the
dashboard process's CPU seconds (user + system, its children not included) per wall second over
`--seconds`: once with nothing running, once with `--concurrent` streamed completions running
again and again (sent from this process, which is not counted). Exit code 1 when a figure is above
its bound (5% of one core idle, 10% busy), so a script can check it.

`--profile FILE` runs the dashboard under cProfile and saves its stats there (pstats format) after
both windows; profiling slows it down, so the figures of such a run are not the ones to quote.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import pty
import struct
import sys
import tempfile
import termios
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

IDLE_BOUND = 0.05  # of one core (issue 13)
BUSY_BOUND = 0.10
CHILD = """\
import cProfile, sys
from pathlib import Path
from tui.app import run_dashboard
config, url, key, profile = sys.argv[1:5]
run = lambda: run_dashboard(config_path=Path(config) if config else None, attach_url=url or None, api_key=key or None)
if profile:
    prof = cProfile.Profile()
    try:
        prof.runcall(run)
    finally:
        prof.dump_stats(profile)
else:
    run()
"""


@dataclass(frozen=True)
class Window:
    """One measured window: what ran, the dashboard's CPU seconds over the wall seconds."""

    name: str
    cpu_s: float
    wall_s: float
    bound: float
    requests: int = 0  # completions finished during it

    @property
    def share(self) -> float:
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def ok(self) -> bool:
        return self.share <= self.bound


def report(windows: list[Window]) -> str:
    """The table this command prints: each window's share of one core next to its bound."""
    lines = ["dashboard process CPU (its CPU seconds per wall second; 100% = one core)"]
    for w in windows:
        done = f", {w.requests} completions finished" if w.name == "busy" else ""
        lines.append(f"  {w.name:<5} {w.share * 100:5.1f}%  bound {w.bound * 100:.0f}%  "
                     f"{'ok' if w.ok else 'ABOVE'}   ({w.cpu_s:.2f} s CPU in {w.wall_s:.1f} s{done})")
    return "\n".join(lines)


def parse_size(text: str) -> tuple[int, int]:
    """`120x40` -> (120, 40); a clear error for anything else."""
    cols, sep, rows = text.lower().partition("x")
    if not sep or not cols.isdigit() or not rows.isdigit() or int(cols) < 40 or int(rows) < 12:
        raise argparse.ArgumentTypeError(f"size must be COLUMNSxROWS, at least 40x12 (got {text!r})")
    return int(cols), int(rows)


def cpu_seconds(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


class Dashboard:
    """The dashboard in its own process on a pseudo terminal; output is read and dropped."""

    def __init__(self, size: tuple[int, int], *, config: Path | None, url: str | None, key: str | None,
                 profile: str | None) -> None:
        pid, self.fd = pty.fork()
        if pid == 0:  # the child: the dashboard, with the pty as its terminal
            os.execv(sys.executable, [sys.executable, "-c", CHILD, str(config or ""), url or "", key or "",
                                      profile or ""])
        cols, rows = size
        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        self.proc = psutil.Process(pid)
        self.shown = 0  # bytes it wrote to its terminal
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        while True:
            try:
                data = os.read(self.fd, 65536)
            except OSError:
                return
            if not data:
                return
            self.shown += len(data)

    def measure(self, name: str, seconds: float, bound: float, load: Load | None = None) -> Window:
        done = load.done if load else 0
        cpu, wall = cpu_seconds(self.proc), time.monotonic()
        time.sleep(seconds)
        cpu, wall = cpu_seconds(self.proc) - cpu, time.monotonic() - wall
        return Window(name, cpu, wall, bound, (load.done - done) if load else 0)

    def close(self) -> None:
        """Quit as a user does (q, then leave the server running: it is stopped by whoever started
        it), so a profile is written; killed if it does not go."""
        with contextlib.suppress(OSError):
            os.write(self.fd, b"q")
            time.sleep(1.0)
            os.write(self.fd, b"l")
        try:
            self.proc.wait(15)
        except psutil.TimeoutExpired:
            self.proc.kill()
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.proc.pid, 0)
        os.close(self.fd)


class Load:
    """`concurrent` threads that each stream completions from `url`, one after another."""

    def __init__(self, url: str, key: str | None, concurrent: int, max_tokens: int) -> None:
        self.url = url.rstrip("/") + "/v1/chat/completions"
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.max_tokens = max_tokens
        self.done = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(concurrent)]
        for thread in self._threads:
            thread.start()

    def _run(self, i: int) -> None:
        body = {"model": "any", "stream": True, "max_tokens": self.max_tokens,
                "messages": [{"role": "user", "content": f"request {i}: tell me about the sea"}]}
        with httpx.Client(timeout=60, headers=self.headers) as client:
            while not self._stop.is_set():
                try:
                    with client.stream("POST", self.url, json=body) as reply:
                        reply.raise_for_status()
                        for _ in reply.iter_lines():
                            pass
                    self.done += 1
                except httpx.HTTPError as exc:
                    self.errors.append(str(exc))
                    time.sleep(1.0)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(70)


def hashlm_server(home: Path, parallel: int) -> tuple[Path, object]:
    """A started server of a HashLM model on the real engine, in `home`: (its config, the process)."""
    import asyncio
    import socket

    from engine import harness
    from engine.hashlm import Rule, write_hashlm
    from server.config import RunConfig, save_config
    from strata_desk.launcher import ServerProcess

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = RunConfig(model=str(write_hashlm(home / "hashlm.gguf", Rule(ends=False))), port=port, parallel=parallel,
                       tokenizer="bytes", device="cpu", engine_command=harness.command(tok_s=25),
                       log=str(home / "engine.log"))
    path = save_config(config, home / "strata-hashlm.json")
    server = ServerProcess(path)
    server.start()
    try:
        asyncio.run(server.wait_ready(120))
    except BaseException:
        server.stop(3)
        raise
    return path, server


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tui.cpu_use", description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=30.0, help="length of each window (default 30)")
    p.add_argument("--warmup", type=float, default=8.0, help="seconds before the idle window (default 8)")
    p.add_argument("--size", type=parse_size, default=(120, 40), help="terminal COLUMNSxROWS (default 120x40)")
    p.add_argument("--concurrent", type=int, default=2, help="completions running at once when busy (default 2)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per completion (default 128)")
    p.add_argument("--url", help="attach to this running server instead of starting a generated one")
    p.add_argument("--key", help="its API key")
    p.add_argument("--profile", metavar="FILE", help="run the dashboard under cProfile, stats saved to FILE")
    args = p.parse_args(argv)
    if args.seconds <= 0 or args.warmup < 0 or args.concurrent < 1 or args.max_tokens < 1:
        p.error("--seconds, --concurrent and --max-tokens must be positive, --warmup not negative")

    with tempfile.TemporaryDirectory(prefix="strata-cpu-") as tmp:
        home = Path(tmp)
        os.environ["STRATA_DESK_HOME"] = str(home / "home")  # the state file, logs: nothing of the user's
        server = None
        config: Path | None = None
        url = args.url
        if url is None:
            print("starting a server of a generated HashLM model ...", flush=True)
            config, server = hashlm_server(home, parallel=max(2, args.concurrent))
            url = server.url  # type: ignore[attr-defined]
        profile = str(Path(args.profile).resolve()) if args.profile else None
        dash = Dashboard(args.size, config=config, url=None if config else url, key=args.key, profile=profile)
        load: Load | None = None
        try:
            time.sleep(args.warmup)
            if not dash.shown:
                print("the dashboard drew nothing: it did not start", file=sys.stderr)
                return 2
            print(f"idle for {args.seconds:g} s ...", flush=True)
            windows = [dash.measure("idle", args.seconds, IDLE_BOUND)]
            load = Load(url, args.key, args.concurrent, args.max_tokens)
            time.sleep(3.0)  # the first requests are running
            print(f"busy ({args.concurrent} streamed completions at a time) for {args.seconds:g} s ...", flush=True)
            windows.append(dash.measure("busy", args.seconds, BUSY_BOUND, load))
        finally:
            if load is not None:
                load.stop()
            dash.close()
            if server is not None:
                server.stop(5)  # type: ignore[attr-defined]
    print(report(windows))
    if load is not None and load.errors:
        print(f"{len(load.errors)} completions failed, the first: {load.errors[0]}")
    if profile:
        print(f"profile saved to {profile} (figures under cProfile are higher than without it)")
    return 0 if all(w.ok for w in windows) else 1


if __name__ == "__main__":
    sys.exit(main())
