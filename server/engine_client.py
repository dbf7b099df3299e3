"""The engine process: spawn, wait for READY, one reader task routing lines, log ring, watchdog.

`EngineProcess` is one run of `python -m engine --serve ...` (or the configured program). Its stdout
is read by a single task: `BT`/`BDONE` go to the per-slot queues, INFO and STATS update the state,
everything else goes to the control queue (read by whoever sent the running GEN/BGEN). Its stderr
goes to the log file and a ring buffer of the last lines. When stdout closes, an `EngineDied` is put
in every queue, so every waiting reader learns it at once.

`EngineSupervisor` keeps one current process (started from an `EngineLaunch`), starts a fresh one when
asked after a death, and runs the silence watchdog. It tells its `EngineWatcher` (the scheduler) when an
engine is ready or died, and asks it whether a request is running or reading a prompt.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from engine.protocol import BDone, BToken, Info, ProtocolError, Ready, Stats, parse_reply
from server.app_dirs import log_dir

LOG_RING = 200


class EngineDied(Exception):
    """The engine process ended (or was ended); the message says why, with the last log lines."""


def stamp() -> str:
    """The time at the start of every line the server writes to its logs."""
    return time.strftime("%H:%M:%S")


def say(msg: str) -> None:
    """Narration on the server's stdout."""
    print(f"{stamp()} [strata] {msg}", flush=True)


class EngineProcess:
    def __init__(self, command: list[str], env: dict[str, str], log_path: Path | None, narrate: bool = True,
                 on_stats: Callable[[dict[str, Any]], None] | None = None,
                 on_death: Callable[[EngineProcess], None] | None = None):
        self.command = command
        self.env = env
        self.log_path = log_path
        self.narrate = narrate
        self.on_stats = on_stats
        self.on_death = on_death
        self.state = "starting"  # starting | ready | dead | stopped
        self.info: dict[str, Any] = {}
        self.context = 0
        self.pid: int | None = None
        self.started_at = time.time()
        self.ready_s: float | None = None
        self.death: str | None = None
        self.log_ring: collections.deque[str] = collections.deque(maxlen=LOG_RING)
        self.control: asyncio.Queue = asyncio.Queue()
        self.slot_queues: list[asyncio.Queue] = []
        self.last_line_at = time.monotonic()
        self._proc: asyncio.subprocess.Process | None = None
        self._ready = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._log_fh = None
        self.kill_reason: str | None = None

    # -- life ---------------------------------------------------------------------------------
    async def start(self) -> None:
        """Spawn and wait for READY. Raises EngineDied if it exits first."""
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_fh = open(self.log_path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115
            self._log_fh.write(f"--- engine start {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(self.command)}\n")
        t0 = time.monotonic()
        try:
            # its own session, so its own process group (uvloop, which uvicorn runs where it is installed,
            # refuses `process_group`): Ctrl+C in the terminal of `strata-desk serve` reaches the server,
            # which ends the engine with QUIT, instead of a KeyboardInterrupt traceback in its log
            self._proc = await asyncio.create_subprocess_exec(
                *self.command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=self.env, limit=16 << 20, start_new_session=True)
        except (OSError, ValueError) as exc:  # ValueError: arguments the event loop does not take
            self._mark_dead(f"the engine could not be started: {exc}")
            raise EngineDied(self.death) from None
        self.pid = self._proc.pid
        self._tasks = [asyncio.create_task(self._read_stdout()), asyncio.create_task(self._read_stderr())]
        waiter = asyncio.create_task(self._ready.wait())
        exited = asyncio.create_task(self._proc.wait())
        await asyncio.wait({waiter, exited}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if not self._ready.is_set() or self.state == "dead":
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.gather(*self._tasks, return_exceptions=True), 2.0)
            exited.cancel()
            if self.state != "dead":
                self._mark_dead("the engine exited before it was ready")
            raise EngineDied(self.death)
        exited.cancel()
        self.ready_s = time.monotonic() - t0

    def send(self, line: str) -> None:
        if self.state != "ready" or self._proc is None or self._proc.stdin is None:
            raise EngineDied(self.death or "the engine is not running")
        self.last_line_at = time.monotonic()  # the silence allowance counts from the last command too
        try:
            self._proc.stdin.write(line.encode() + b"\n")
        except (ConnectionError, RuntimeError) as exc:
            raise EngineDied(f"cannot write to the engine: {exc}") from None

    def kill(self, reason: str) -> None:
        """End the process now (watchdog, shutdown); the reader reports the death with `reason`."""
        self.kill_reason = reason
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()

    async def stop(self, timeout: float = 10.0) -> None:
        """QUIT, close stdin, wait; kill if it takes too long."""
        if self._proc is None or self._proc.returncode is not None:
            self.state = "stopped"
            return
        self.kill_reason = "stopped"
        with contextlib.suppress(Exception):
            if self._proc.stdin is not None:
                self._proc.stdin.write(b"QUIT\n")
                self._proc.stdin.close()
        try:
            await asyncio.wait_for(self._proc.wait(), timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
            await self._proc.wait()
        for t in self._tasks:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(t, 2.0)
        self.state = "stopped"
        self._close_log()

    @property
    def alive(self) -> bool:
        return self.state == "ready"

    def log_tail(self, n: int = 20) -> list[str]:
        return list(self.log_ring)[-n:]

    # -- readers ------------------------------------------------------------------------------
    async def _read_stdout(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        stdout = self._proc.stdout
        control = self.control
        while True:
            try:
                raw = await stdout.readline()
            except (ValueError, asyncio.LimitOverrunError) as exc:
                self._log(f"(server) unreadable engine line: {exc}")
                continue
            if not raw:
                break
            self.last_line_at = time.monotonic()
            line = raw.decode("utf-8", "replace")
            try:
                reply = parse_reply(line)
            except ProtocolError as exc:
                self._log(f"(server) {exc}")
                continue
            t = type(reply)
            if t is BToken or t is BDone:
                slot = reply.slot
                if 0 <= slot < len(self.slot_queues):
                    self.slot_queues[slot].put_nowait(reply)
                else:
                    self._log(f"(server) line for unknown slot: {line.strip()}")
            elif t is Stats:
                if self.on_stats is not None:
                    self.on_stats(reply.data)
            elif t is Info:
                self.info.update(reply.values)
                n = self.info.get("batch_slots", 0)
                if isinstance(n, int) and n > len(self.slot_queues):
                    self.slot_queues += [asyncio.Queue() for _ in range(n - len(self.slot_queues))]
            elif t is Ready:
                self.context = reply.context
                self.state = "ready"
                self._ready.set()
            else:
                control.put_nowait(reply)
        code = await self._proc.wait()
        await asyncio.sleep(0.05)  # let the stderr reader catch the last lines
        if self.kill_reason == "stopped":
            self.state = "stopped"
            return
        reason = self.kill_reason or f"the engine exited (code {code})"
        tail = self.log_tail(20)
        self._mark_dead(reason + (":\n" + "\n".join(tail) if tail else ""))

    async def _read_stderr(self) -> None:
        assert self._proc is not None and self._proc.stderr is not None
        while True:
            try:
                raw = await self._proc.stderr.readline()
            except (ValueError, asyncio.LimitOverrunError):
                continue
            if not raw:
                break
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self._log(line)
            if self.narrate and self.state == "starting":
                say(f"engine: {line}")

    def _log(self, line: str) -> None:
        self.log_ring.append(line)
        if self._log_fh is not None:
            with contextlib.suppress(OSError, ValueError):
                self._log_fh.write(f"{stamp()} {line}\n")

    def _mark_dead(self, reason: str) -> None:
        if self.state in ("dead", "stopped"):
            return
        self.state = "dead"
        self.death = reason
        died = EngineDied(reason)
        self.control.put_nowait(died)
        for q in self.slot_queues:
            q.put_nowait(died)
        self._ready.set()
        self._close_log()
        if self.on_death is not None:
            self.on_death(self)

    def _close_log(self) -> None:
        if self._log_fh is not None:
            with contextlib.suppress(OSError):
                self._log_fh.close()
            self._log_fh = None


@dataclass(frozen=True)
class EngineLaunch:
    """How to run the engine: its command line, environment and log file, and the watchdog's allowance
    (`silence_s`, 0 = off; more while a prompt of `prefill`-token chunks is read)."""

    command: list[str]
    env: dict[str, str]
    log_path: Path | None
    silence_s: float
    prefill: int = 512


class EngineWatcher(Protocol):
    """What the supervisor tells about the engine, and asks about the work on it (the scheduler)."""

    def engine_ready(self, engine: EngineProcess) -> None: ...

    def engine_died(self, engine: EngineProcess) -> None: ...

    def busy(self) -> bool:
        """A request is on the engine (the watchdog only watches then)."""
        ...

    def reading(self) -> tuple[bool, float]:
        """Whether a prompt is being read, and the seconds its last chunk took."""
        ...


class EngineSupervisor:
    """Owns the current engine process: (re)starts it on demand, and the silence watchdog."""

    def __init__(self, launch: EngineLaunch, watcher: EngineWatcher,
                 on_stats: Callable[[dict[str, Any]], None] | None = None):
        self.launch = launch
        self.watcher = watcher
        self.on_stats = on_stats
        self.engine: EngineProcess | None = None
        self.restarts = 0
        self.starts = 0
        self.last_error: str | None = None
        self._lock = asyncio.Lock()
        self._watchdog: asyncio.Task | None = None

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.alive

    @property
    def state(self) -> str:
        if self.engine is None:
            return "starting"
        return self.engine.state

    async def ensure_ready(self) -> EngineProcess:
        async with self._lock:
            if self.engine is not None and self.engine.alive:
                return self.engine
            if self.engine is not None:
                self.restarts += 1
                say("restarting the engine")
            else:
                say("starting the engine: " + " ".join(self.launch.command))
            self.starts += 1
            engine = EngineProcess(self.launch.command, self.launch.env, self.launch.log_path, on_stats=self.on_stats,
                                   on_death=self._died)
            self.engine = engine
            ticker = asyncio.create_task(self._still_starting(engine))
            try:
                await engine.start()
            except EngineDied as exc:
                self.last_error = str(exc)
                say(f"the engine failed to start: {exc}")
                raise
            finally:
                ticker.cancel()
            info = " ".join(f"{k}={v}" for k, v in engine.info.items())
            say(f"engine ready in {engine.ready_s:.1f} s: context {engine.context}" + (f" ({info})" if info else ""))
            n = engine.info.get("batch_slots")
            if n is not None:
                say(f"parallel requests: the engine runs {n} batch slots")
            if self._watchdog is None or self._watchdog.done():
                self._watchdog = asyncio.create_task(self._watch())
            self.watcher.engine_ready(engine)
            return engine

    async def _still_starting(self, engine: EngineProcess, every_s: float = 10.0) -> None:
        t0 = time.monotonic()
        while True:
            await asyncio.sleep(every_s)
            say(f"still starting ({time.monotonic() - t0:.0f} s)")

    def _died(self, engine: EngineProcess) -> None:
        self.last_error = engine.death
        if engine is self.engine:
            say(f"the engine died: {(engine.death or '').splitlines()[0]}")
            self.watcher.engine_died(engine)

    def allowance(self) -> float:
        """Seconds of silence allowed now (upstream's rule: more while a prompt chunk is read)."""
        if self.launch.silence_s <= 0:
            return float("inf")
        reading, last_chunk_s = self.watcher.reading()
        if reading:
            return max(self.launch.silence_s, self.launch.prefill / 50.0, 3.0 * last_chunk_s)
        return self.launch.silence_s

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(min(0.25, max(self.launch.silence_s / 4, 0.05)) if self.launch.silence_s > 0 else 1.0)
            engine = self.engine
            if engine is None or not engine.alive or not self.watcher.busy():
                continue
            silent = time.monotonic() - engine.last_line_at
            if silent > self.allowance():
                say(f"the engine was silent for {silent:.0f} s during a request: ending it")
                engine.kill(f"the engine was silent for {silent:.1f} s during a request "
                            f"(engine_silence_s = {self.launch.silence_s:g}) and was stopped by the watchdog")

    async def shutdown(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self.engine is not None:
            await self.engine.stop()


def default_log_path(config_log: str | None, model_name: str) -> Path:
    """The engine's log: the config's `log`, else `strata-<model>.log` in the log dir (`server.app_dirs`)."""
    if config_log:
        return Path(config_log).expanduser()
    return log_dir() / f"strata-{model_name}.log"
