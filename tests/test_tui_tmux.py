"""The dashboard in a real terminal: tmux starts it on a config for the real engine on a HashLM model,
the screen is read with capture-pane, keys are sent (help, a panel toggle, quit -> stop the server),
and the process must exit 0 with the server stopped. Skipped only when tmux is not installed."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from ports import free_port

from engine import harness
from engine.hashlm import write_hashlm
from server.config import RunConfig, save_config

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
    pytest.mark.skipif(not (ROOT / "server" / "__main__.py").is_file(), reason="needs the server"),
]


def hashlm_config(tmp_path: Path) -> Path:
    config = RunConfig(model=str(write_hashlm(tmp_path / "hashlm.gguf")), port=free_port(), parallel=4,
                       tokenizer="bytes", device="cpu", engine_command=harness.command(tok_s=50),
                       log=str(tmp_path / "engine.log"))
    return save_config(config, tmp_path / "strata-hashlm.json")


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], check=True, capture_output=True, text=True).stdout


def screen(session: str) -> str:
    return tmux("capture-pane", "-p", "-t", session)


def wait_screen(session: str, needle: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = screen(session)
        if needle in text:
            return text
        time.sleep(0.2)
    raise AssertionError(f"{needle!r} not on screen within {timeout} s:\n{text}")


def test_dashboard_in_tmux(tmp_path: Path) -> None:
    home = tmp_path / "home"
    config = hashlm_config(tmp_path)
    done = tmp_path / "exit-code"
    session = f"strata-desk-test-{tmp_path.name}"
    script = (f"from pathlib import Path; from tui.app import run_dashboard; "
              f"raise SystemExit(run_dashboard(config_path=Path({str(config)!r})))")
    command = (f"cd {ROOT} && STRATA_DESK_HOME={home} {sys.executable} -c {script!r}; "
               f"echo $? > {done}")
    tmux("new-session", "-d", "-s", session, "-x", "100", "-y", "30", command)
    try:
        wait_screen(session, "Slots 0/4 busy", 40)
        text = wait_screen(session, "No GPU", 10)
        assert "1 Slots" in text and "/v1" in text and "No GPU" in text
        url = text[text.index("http://"):].split()[0].removesuffix("/v1")
        assert httpx.get(url + "/health", timeout=5).status_code == 200

        tmux("send-keys", "-t", session, "?")
        wait_screen(session, "strata-desk: keys", 10)
        tmux("send-keys", "-t", session, "Escape")
        time.sleep(0.5)
        tmux("send-keys", "-t", session, "2")  # hide the throughput panel
        deadline = time.monotonic() + 10
        while "2 Throughput" in screen(session) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "2 Throughput" not in screen(session)

        tmux("send-keys", "-t", session, "q")
        wait_screen(session, "Stop the server", 10)
        tmux("send-keys", "-t", session, "s")
        deadline = time.monotonic() + 30
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert done.exists(), screen(session)
        assert done.read_text().strip() == "0"
        with pytest.raises(httpx.HTTPError):
            httpx.get(url + "/health", timeout=2)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
