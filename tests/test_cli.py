"""strata_desk.cli: every subcommand's wiring and its one-line errors (exit code 2).

The dashboard, the server's main, the engine's bench/check and the test-model generator are
replaced by recorders here; their own tests cover them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
from test_setup import write_tiny_gguf

from engine.hashlm import write_hashlm
from strata_desk import cli, paths, setup
from strata_desk.cli import main
from strata_desk.probe import HardwareInfo

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv(paths.HOME_ENV, str(tmp_path / "home"))
    monkeypatch.setattr(setup, "probe_hardware", lambda: HardwareInfo(ram_gib=32.0, cpu_cores=2))


@pytest.fixture
def model(tmp_path) -> Path:
    return write_tiny_gguf(tmp_path / "Tiny-MoE.gguf")


@pytest.fixture
def dashboard(monkeypatch):
    calls: list[tuple] = []
    module = types.ModuleType("tui.app")

    def run_dashboard(config_path=None, **kwargs):
        calls.append((config_path, kwargs))
        return 0

    module.run_dashboard = run_dashboard
    monkeypatch.setitem(sys.modules, "tui.app", module)
    return calls


@pytest.fixture
def server_main(monkeypatch):
    calls: list[list[str]] = []

    def fake(argv):
        calls.append(argv)
        return 0

    monkeypatch.setattr(cli, "_server_main", lambda: fake)
    return calls


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for command in ("serve", "setup", "info", "ps", "stop", "make-test-model", "bench", "bench-engine", "check",
                    "attach", "install-desktop", "install-service"):
        assert command in out


def test_bad_arguments_one_line(capsys):
    assert main(["--port", "0"]) == 2
    assert main(["serve", "--parallel", "x"]) == 2
    assert main(["frobnicate"]) == 2
    for line in capsys.readouterr().err.strip().splitlines():
        assert line.startswith("strata-desk")


def test_setup_writes_config(model, capsys):
    assert main(["setup", str(model), "--yes", "--parallel", "2", "--context", "1024"]) == 0
    out = capsys.readouterr().out
    path = paths.config_dir() / "strata-tiny-moe.json"
    assert f"wrote {path}" in out and "kept as you chose (2)" in out
    data = json.loads(path.read_text())
    assert data["parallel"] == 2 and data["context"] == 1024 and data["model"] == str(model.resolve())
    assert paths.last_config() == path


def test_setup_errors(tmp_path, capsys):
    assert main(["setup", str(tmp_path / "nope.gguf"), "--yes"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"strata-desk: error: model file not found: {tmp_path / 'nope.gguf'}"
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"XXXX" + bytes(32))
    assert main(["setup", str(bad), "--yes"]) == 2
    assert "not a GGUF" in capsys.readouterr().err


def test_dashboard_first_run(dashboard):
    assert main([]) == 0
    assert dashboard == [(None, {})]


def test_dashboard_with_model_makes_then_reuses_config(model, dashboard, capsys):
    assert main(["--model", str(model), "--port", "9001"]) == 0
    path = paths.config_dir() / "strata-tiny-moe.json"
    assert dashboard[-1] == (path, {"port": 9001})
    assert "wrote" in capsys.readouterr().out
    assert main(["--model", str(model), "--parallel", "3"]) == 0
    assert json.loads(path.read_text())["parallel"] == 3
    assert main([]) == 0  # the last used config
    assert dashboard[-1] == (path, {})


def test_dashboard_missing_model(tmp_path, dashboard, capsys):
    assert main(["--model", str(tmp_path / "x.gguf")]) == 2
    assert "model file not found" in capsys.readouterr().err
    assert dashboard == []


def test_demo(model, dashboard, monkeypatch):
    module = types.ModuleType("strata_desk.demo")
    module.demo_model_path = lambda: model
    monkeypatch.setitem(sys.modules, "strata_desk.demo", module)
    assert main(["--demo"]) == 0
    assert dashboard[-1][0] == paths.config_path_for(model)


def test_serve(model, server_main, tmp_path, capsys):
    assert main(["serve"]) == 2
    assert "no config" in capsys.readouterr().err
    assert main(["serve", "--model", str(model), "--port", "9002", "--api-key", "k"]) == 0
    path = paths.config_path_for(model)
    assert server_main[-1] == ["--config", str(path), "--port", "9002", "--api-key", "k"]
    assert main(["serve"]) == 0  # the last used config
    assert server_main[-1] == ["--config", str(path)]
    assert main(["serve", "--config", str(path), "--parallel", "2", "--host", "0.0.0.0"]) == 0
    assert json.loads(path.read_text())["parallel"] == 2
    assert server_main[-1] == ["--config", str(path), "--host", "0.0.0.0"]


def test_serve_bad_config(tmp_path, server_main, capsys):
    bad = tmp_path / "strata-bad.json"
    bad.write_text(json.dumps({"model": "/m.gguf", "parallel": 0}))
    assert main(["serve", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "parallel" in err
    assert main(["serve", "--config", str(tmp_path / "none.json")]) == 2
    assert "config file not found" in capsys.readouterr().err
    assert main(["serve", "--demo", "--config", str(bad)]) == 2
    assert "choose one of --demo, --config" in capsys.readouterr().err
    assert server_main == []


def test_info(model, capsys):
    main(["setup", str(model), "--yes"])
    capsys.readouterr()
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"config dir: {paths.config_dir()}" in out
    assert "strata-tiny-moe.json" in out and "running servers (0)" in out


def test_passthrough(model, monkeypatch):
    seen = {}
    for name in ("engine.bench", "engine.check"):
        module = types.ModuleType(name)
        module.main = lambda argv, name=name: seen.setdefault(name, argv) and 0
        monkeypatch.setitem(sys.modules, name, module)
    assert main(["bench-engine", "--model", str(model), "--tokens", "5"]) == 0
    assert main(["check", "--help-me"]) == 0
    assert seen == {"engine.bench": ["--model", str(model), "--tokens", "5"], "engine.check": ["--help-me"]}


def test_make_test_model(monkeypatch, tmp_path):
    module = types.ModuleType("strata_desk.testmodel")
    got = {}
    module.add_arguments = lambda parser: parser.add_argument("--out")
    module.main = lambda args: got.setdefault("out", args.out) and 0
    monkeypatch.setitem(sys.modules, "strata_desk.testmodel", module)
    assert main(["make-test-model", "--out", str(tmp_path / "t.gguf")]) == 0
    assert got["out"] == str(tmp_path / "t.gguf")
    assert main(["make-test-model", "--bogus"]) == 2


def test_attach(dashboard, capsys):
    assert main(["attach"]) == 2
    assert "no running server known" in capsys.readouterr().err
    assert main(["attach", "http://127.0.0.1:9"]) == 2
    assert "no server answers at http://127.0.0.1:9" in capsys.readouterr().err


def test_attach_running_stand_in(dashboard, tmp_path):
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{httpd.server_port}"
        assert main(["attach", url, "--key", "sekrit"]) == 0
        assert dashboard[-1] == (None, {"attach_url": url, "api_key": "sekrit"})
    finally:
        httpd.shutdown()


def test_console_script_runs():
    result = subprocess.run([sys.executable, "-m", "strata_desk", "info"], capture_output=True, text=True,
                            cwd=ROOT, timeout=60)
    assert result.returncode == 0 and "config dir:" in result.stdout


def test_serve_refuses_when_already_running(model, server_main, capsys):
    import os

    from strata_desk import state

    assert main(["setup", str(model), "--yes"]) == 0
    path = paths.config_path_for(model)
    state.record(state.RunningServer(os.getpid(), "http://127.0.0.1:8080", str(path),
                                     create_time=state.process_create_time(os.getpid())))
    capsys.readouterr()
    assert main(["serve", "--config", str(path)]) == 2
    assert "already running at http://127.0.0.1:8080" in capsys.readouterr().err
    assert server_main == []


def test_demo_missing_is_one_line(dashboard, monkeypatch, capsys):
    module = types.ModuleType("strata_desk.demo")

    def missing():
        raise RuntimeError("the demo model is not installed; install it with: pip install 'strata-desk[demo]'")

    module.demo_model_path = missing
    monkeypatch.setitem(sys.modules, "strata_desk.demo", module)
    assert main(["serve", "--demo"]) == 2
    assert capsys.readouterr().err.strip() == (
        "strata-desk: error: the demo model is not installed; install it with: pip install 'strata-desk[demo]'")


def _hashlm_config(tmp_path: Path, port: int) -> Path:
    """A config serving a HashLM file (engine/hashlm.py) with the real engine."""
    config = tmp_path / "strata-hashlm.json"
    config.write_text(json.dumps({
        "model": str(write_hashlm(tmp_path / "hashlm.gguf")), "tokenizer": "bytes", "device": "cpu", "port": port,
        "log": str(tmp_path / "engine.log")}))
    return config


def _serve_until_healthy(config: Path, port: int, **popen) -> subprocess.Popen:
    """`strata-desk serve --config FILE` in a subprocess, once /health answers 200."""
    import time

    import httpx

    proc = subprocess.Popen([sys.executable, "-m", "strata_desk", "serve", "--config", str(config)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("serve was not healthy within 60 s")


def test_serve_headless_for_real(tmp_path):
    """`strata-desk serve` runs the real server and engine, is recorded while it runs, and leaves
    no record after SIGTERM."""
    import os
    import signal

    from ports import free_port

    from strata_desk.state import find_running

    port = free_port()
    config = _hashlm_config(tmp_path, port)
    proc = _serve_until_healthy(config, port)
    try:
        [record] = find_running()
        assert record.pid == proc.pid and record.url == f"http://127.0.0.1:{port}"
        assert main(["serve", "--config", str(config)]) == 2  # already running
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    assert find_running() == []


def test_serve_ctrl_c_leaves_no_traceback_in_the_engine_log(tmp_path):
    """Ctrl+C in the terminal signals the whole foreground group: the server ends its engine with
    QUIT, so the engine log (which a dashboard opened later shows) holds no KeyboardInterrupt."""
    import os
    import signal

    from ports import free_port

    port = free_port()
    config = _hashlm_config(tmp_path, port)
    proc = _serve_until_healthy(config, port, start_new_session=True)  # a group of its own, as a terminal's job
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    log = (tmp_path / "engine.log").read_text()
    assert "KeyboardInterrupt" not in log and "Traceback" not in log, log
    assert "Traceback" not in out, out


def test_serve_config_whose_model_is_missing_exits(tmp_path, server_main, capsys):
    """A config's model is checked before serving, as --model is (so systemd sees the failure)."""
    config = tmp_path / "strata-gone.json"
    config.write_text(json.dumps({"model": str(tmp_path / "gone.gguf")}))
    assert main(["serve", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err == f"strata-desk: error: model file not found: {tmp_path / 'gone.gguf'} (the model of {config})\n"
    assert server_main == []


def test_refused_serve_changes_nothing(model, server_main, dashboard, capsys):
    """--parallel has one limit everywhere (the engine's 8 slots), and a refused command writes nothing."""
    import os

    from strata_desk import state

    assert main(["setup", str(model), "--yes", "--parallel", "2"]) == 0
    path = paths.config_path_for(model)
    before = path.read_bytes()
    capsys.readouterr()
    assert main(["serve", "--config", str(path), "--parallel", "99"]) == 2
    assert "--parallel: must be 1..8" in capsys.readouterr().err
    assert main(["setup", str(model), "--yes", "--parallel", "12"]) == 2
    assert main(["--model", str(model), "--parallel", "9"]) == 2
    state.record(state.RunningServer(os.getpid(), "http://127.0.0.1:8080", str(path),
                                     create_time=state.process_create_time(os.getpid())))
    assert main(["serve", "--config", str(path), "--parallel", "3"]) == 2  # already running
    assert main(["serve", "--model", str(model), "--parallel", "3"]) == 2
    assert path.read_bytes() == before and server_main == []


def test_serve_on_a_busy_port_says_so(model, server_main, tmp_path, capsys):
    import socket

    assert main(["setup", str(model), "--yes"]) == 0
    path = paths.config_path_for(model)
    before = path.read_bytes()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        capsys.readouterr()
        assert main(["serve", "--config", str(path), "--port", str(port), "--parallel", "2"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"strata-desk: error: port {port} on 127.0.0.1 is already in use") and err.count("\n") == 1
        assert path.read_bytes() == before and server_main == []
        # the server itself (python -m server, and serve when the port is taken in between) says it too
        config = _hashlm_config(tmp_path, port)
        result = subprocess.run([sys.executable, "-m", "server", "--config", str(config)], cwd=ROOT,
                                capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stdout == "" and "serving" not in result.stderr and "Errno" not in result.stderr
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in result.stderr


def test_check_and_bench_engine_bad_model_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"XXXX" + bytes(32))
    for command in ("check", "bench-engine"):
        assert main([command, "--model", str(tmp_path / "none.gguf")]) == 2
        assert capsys.readouterr().err == f"strata-desk: error: model file not found: {tmp_path / 'none.gguf'}\n"
        assert main([command, f"--model={bad}"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("strata-desk: error: ") and "not a GGUF file" in err and err.count("\n") == 1


def test_ps_and_stop(model, capsys):
    """ps lists what the state file holds; stop NAME ends it; an unknown name changes nothing."""
    from strata_desk import state

    assert main(["setup", str(model), "--yes"]) == 0
    path = paths.config_path_for(model)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        state.record(state.RunningServer(sleeper.pid, "http://127.0.0.1:8123", str(path),
                                         create_time=state.process_create_time(sleeper.pid)))
        capsys.readouterr()
        assert main(["ps"]) == 0
        header, row = capsys.readouterr().out.splitlines()
        assert header.split() == ["NAME", "PID", "URL", "UPTIME", "CONFIG"]
        assert row.split()[:3] == ["tiny-moe", str(sleeper.pid), "http://127.0.0.1:8123"] and str(path) in row
        assert main(["stop", "nope"]) == 2
        assert "no running server named 'nope' (running: tiny-moe" in capsys.readouterr().err
        assert sleeper.poll() is None and len(state.find_running()) == 1
        assert main(["stop", "tiny-moe"]) == 0
        assert "stopped tiny-moe" in capsys.readouterr().out
        assert sleeper.wait(timeout=10) is not None and state.find_running() == []
        assert main(["ps"]) == 0 and "no server" in capsys.readouterr().out
    finally:
        sleeper.kill()
