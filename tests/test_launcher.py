"""strata_desk.launcher: start, wait_ready, stop, restart, the state file.

Two layers: a stand-in HTTP server (a few lines of http.server, below) tests the supervision logic
on its own; the real `python -m server` and engine (on a HashLM model, engine/hashlm.py) run too.
"""

from __future__ import annotations

import socket
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
from ports import free_port

from engine.hashlm import write_hashlm
from server.config import RunConfig, save_config
from server.urls import connect_host
from strata_desk import paths, state
from strata_desk.launcher import LaunchError, ServerProcess, find_running, running_for

ROOT = Path(__file__).resolve().parent.parent
HAVE_SERVER = (ROOT / "server" / "__main__.py").is_file()

STAND_IN = textwrap.dedent('''
    import http.server, signal, sys, time
    port, ready_after, mode = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    if mode == "crash":
        print("engine: cannot load model: boom", flush=True)
        sys.exit(3)
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, lambda *a: print("ignoring SIGTERM", flush=True))
    start = time.monotonic()
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            ok = time.monotonic() - start >= ready_after
            self.send_response(200 if ok else 503)
            self.end_headers()
            self.wfile.write(b"ok" if ok else b"loading")
        def log_message(self, *a):
            pass
    print("stand-in listening", flush=True)
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
''')


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv(paths.HOME_ENV, str(tmp_path / "home"))


def make_config(tmp_path: Path, port: int, **extra) -> Path:
    return save_config(RunConfig(model=str(tmp_path / "model.gguf"), port=port, **extra),
                       tmp_path / "strata-test.json")


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    started: list[ServerProcess] = []

    def make(ready_after: float = 0.5, mode: str = "normal") -> ServerProcess:
        port = free_port()
        proc = ServerProcess(make_config(tmp_path, port))
        monkeypatch.setattr(proc, "command",
                            lambda: [sys.executable, str(script), str(port), str(ready_after), mode])
        started.append(proc)
        return proc

    yield make
    for proc in started:
        proc.stop(timeout=2)


def test_connect_host():
    assert connect_host("0.0.0.0") == "127.0.0.1"
    assert connect_host("::") == "::1"
    assert connect_host("192.168.1.5") == "192.168.1.5"


async def test_start_wait_stop(stand_in):
    proc = stand_in(ready_after=0.6)
    progress: list[str] = []
    proc.start()
    assert proc.running
    records = find_running()
    assert [r.pid for r in records] == [proc.pid] and records[0].url == proc.url
    assert running_for(proc.config_path).pid == proc.pid
    await proc.wait_ready(20, progress.append)
    assert progress[-1].startswith("ready after")
    assert any("loading" in p or "starting" in p for p in progress[:-1])
    assert httpx.get(proc.url + "/health").status_code == 200
    assert "stand-in listening" in "\n".join(proc.log_tail())
    assert paths.last_config() == proc.config_path
    proc.stop()
    assert not proc.running
    assert find_running() == []


async def test_crash_raises_with_log_tail(stand_in):
    proc = stand_in(mode="crash")
    proc.start()
    with pytest.raises(LaunchError, match="exited") as info:
        await proc.wait_ready(20)
    assert any("boom" in line for line in info.value.log_tail)
    assert find_running() == []


async def test_timeout_raises(stand_in):
    proc = stand_in(ready_after=60)
    proc.start()
    with pytest.raises(LaunchError, match="not ready after"):
        await proc.wait_ready(1.0)


def test_stop_kills_a_stubborn_server(stand_in):
    proc = stand_in(mode="stubborn")
    proc.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    proc.stop(timeout=1)
    assert not proc.running
    assert time.monotonic() - t0 < 8


async def test_restart_and_adopt(stand_in):
    proc = stand_in(ready_after=0.0)
    proc.start()
    await proc.wait_ready(20)
    first = proc.pid
    proc.restart()
    await proc.wait_ready(20)
    assert proc.pid != first
    # a later dashboard finds it in the state file and can stop it
    [record] = find_running()
    adopted = ServerProcess.adopt(record)
    assert adopted.running and adopted.url == proc.url
    adopted.stop(timeout=5)
    assert find_running() == []


def test_port_in_use(stand_in, tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        proc = ServerProcess(make_config(tmp_path, port))
        with pytest.raises(LaunchError, match="already in use"):
            proc.start()


def test_state_drops_dead_pids():
    state.record(state.RunningServer(pid=2**22 + 12345, url="http://127.0.0.1:1"))
    assert find_running() == []
    assert state.state_file().is_file()


# -- the real server and engine ----------------------------------------------------------------


@pytest.mark.skipif(not HAVE_SERVER, reason="server/__main__.py has not landed yet")
async def test_real_server_and_engine(tmp_path):
    port = free_port()
    write_hashlm(tmp_path / "model.gguf")
    config = make_config(tmp_path, port, tokenizer="bytes", device="cpu", model_name="hashlm",
                         log=str(tmp_path / "engine.log"))
    proc = ServerProcess(config)
    proc.start()
    try:
        await proc.wait_ready(60)
        reply = httpx.get(proc.url + "/v1/models", timeout=10)
        assert reply.status_code == 200 and reply.json()["data"][0]["id"] == "hashlm"
        proc.restart()
        await proc.wait_ready(60)
        assert httpx.get(proc.url + "/health", timeout=10).status_code == 200
    finally:
        proc.stop()
    assert not proc.running
    assert find_running() == []


@pytest.mark.skipif(not HAVE_SERVER, reason="server/__main__.py has not landed yet")
async def test_error_status_fails_fast(tmp_path):
    """A server that reports a permanent error on /health (here: a model file that is not there, so no
    vocabulary) fails at once instead of waiting for the timeout."""
    proc = ServerProcess(make_config(tmp_path, free_port(), log=str(tmp_path / "engine.log")))
    proc.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(LaunchError, match="reports an error"):
            await proc.wait_ready(60)
        assert time.monotonic() - t0 < 30
    finally:
        proc.stop()
    assert find_running() == []


async def test_async_stop_and_restart(stand_in):
    proc = stand_in(ready_after=0.0)
    proc.start()
    await proc.wait_ready(20)
    first = proc.pid
    await proc.arestart()
    await proc.wait_ready(20)
    assert proc.pid != first and proc.running
    await proc.astop()
    assert not proc.running and find_running() == []
