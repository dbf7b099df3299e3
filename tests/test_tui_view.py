"""The header and the banner as pure functions of the dashboard's state (tui/view.py), without
Textual: which message wins in each lifecycle phase, and which keys are offered."""

from __future__ import annotations

from tui import preview
from tui.view import GENERATED_NOTE, DeskState, banner, header_info, layer_split_note

URL = "http://127.0.0.1:8080/v1"


def desk(phase: str, **kw: object) -> DeskState:
    return DeskState(phase=phase, url=URL, base_url="http://127.0.0.1:8080", **kw)  # type: ignore[arg-type]


def test_failed_start_shows_the_tail_and_the_keys_that_help() -> None:
    tail = [f"line {i}" for i in range(20)]
    level, message, detail, keys = banner(desk("failed", failure=("The server could not be started", tail),
                                               backup_exists=True, can_manage=True))
    assert (level, message) == ("error", "The server could not be started")
    assert detail.splitlines() == tail[-12:]
    assert keys.split("   ") == ["u restore the previous config (.bak) and restart", "r try again", "s settings",
                                   "l full log", "q quit"]
    _, _, _, attached_keys = banner(desk("failed", failure=("x", []), mode="attached"))
    assert attached_keys == "l full log   q quit"


def test_start_and_drain_say_what_is_under_way() -> None:
    lines = ("a", "b", "c", "d")
    assert banner(desk("restarting", progress="loading (503), 4 s", server_lines=lines)) == (
        "info", "Restarting the server and the engine: loading (503), 4 s", "b\nc\nd", "")
    level, message, _, keys = banner(desk("draining", inflight=3, snapshot=preview.busy()))
    assert level == "warn" and "3 request(s)" in message and keys == "x restart now   esc cancel the restart"
    info = header_info(desk("draining", inflight=3, snapshot=preview.busy()))
    assert info.detail == "draining: 3 in flight" and info.state == "busy"
    starting = header_info(desk("starting", progress="starting, 2 s", served_name="qwen"))
    assert (starting.state, starting.model, starting.detail, starting.uptime_s) == ("loading", "qwen",
                                                                                   "starting, 2 s", None)


def test_running_banner_by_priority() -> None:
    busy = preview.busy()
    assert banner(desk("running", snapshot=busy)) == (None, "", "", "")
    assert banner(desk("running", snapshot=busy, bench_status="arm 2/3"))[1] == "Benchmark running: arm 2/3"
    err = banner(desk("attached", snapshot=busy, poll_error="connection refused"))
    assert err[0] == "error" and err[1] == "Cannot read http://127.0.0.1:8080/metrics: connection refused"
    dead = banner(desk("running", snapshot=preview.dead(), can_manage=True))
    assert dead[1] == "The engine stopped: engine exited with code 3: CUDA error: out of memory"
    assert dead[2] == "restarts so far: 2" and "r restart now" in dead[3]
    assert banner(desk("running", snapshot=preview.cpu_moe_simulated())) == ("info", GENERATED_NOTE, "", "")


def test_header_from_a_snapshot() -> None:
    info = header_info(desk("running", snapshot=preview.busy(), mode="attached"))
    assert (info.model, info.state, info.url, info.mode, info.detail) == (
        "Qwen3-30B-A3B-Q4_K_M", "busy", URL, "attached", "answering")
    assert info.uptime_s == preview.busy().uptime_s and info.version == "0.1.0"
    assert header_info(desk("stopping", snapshot=preview.busy())).state == "stopped"
    assert header_info(desk("failed", failure=("x", []))).state == "error"


def test_layer_split_note_only_from_an_engine_that_lists_it() -> None:
    """Which options have no effect as the form stands: tests/test_tui_settings.py."""
    engine = preview.busy().engine
    assert layer_split_note(engine) is None
    engine.info["unsupported"] = "batch_mtp,layer_split"
    assert layer_split_note(engine) == "not run by this engine yet: one device runs every layer"
    assert layer_split_note(None) is None
