"""Pilot tests of every screen against a real server process (`python -m server`) running the real
engine on a HashLM model (engine/hashlm.py, paced by engine/harness.py): the dashboard starts and
stops it as a user would.

Covered: start-up to ready; a state change at the server on screen within 2 s; settings
validation (RunConfig's rules, unsupported options); apply-and-restart (diff, config + .bak,
the new setting live); restart with requests in flight (drain: they finish; now: they end with an
error); a failed start with its log tail and `u` restoring the .bak; quit choices (stop, or leave
running and attach again); the bench screen with two arms; the first-run screen.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import json
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from ports import free_port

from engine import harness
from engine.hashlm import Rule, write_hashlm
from server.config import RunConfig, load_config, save_config
from strata_desk import paths, state
from tui.app import StrataDeskApp, backup_path

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(not (ROOT / "server" / "__main__.py").is_file(), reason="needs the server")

SIZE = (120, 40)


@pytest.fixture(autouse=True)
def desk_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Every path of strata-desk under tmp; servers left running are stopped at the end."""
    home = tmp_path / "home"
    monkeypatch.setenv(paths.HOME_ENV, str(home))
    yield home
    for record in state.find_running():
        with contextlib.suppress(Exception):
            from strata_desk.launcher import ServerProcess

            ServerProcess.adopt(record).stop(timeout=3)


def hashlm_config(tmp_path: Path, *, parallel: int = 4, ends: bool = False, name: str = "strata-hashlm.json",
                  **switches: float) -> Path:
    """A config for the real engine on a HashLM file whose replies end by themselves only with `ends`,
    with the harness's `switches` (default 25 decode steps a second)."""
    switches.setdefault("tok_s", 25)
    config = RunConfig(model=str(write_hashlm(tmp_path / "hashlm.gguf", Rule(ends=ends))), port=free_port(),
                       parallel=parallel, tokenizer="bytes", device="cpu", engine_command=harness.command(**switches),
                       log=str(tmp_path / "engine.log"))
    return save_config(config, tmp_path / name)


def screen_text(app: StrataDeskApp) -> str:
    """What the terminal shows, as plain text (from Textual's own SVG export)."""
    svg = app.export_screenshot()
    svg = re.sub(r"<style.*?</style>", "", svg, flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", "", svg)).replace("\xa0", " ")


def shows(app: StrataDeskApp, *texts: str) -> bool:
    screen = screen_text(app)
    return all(text in screen for text in texts)


async def wait_for(pilot, predicate: Callable[[], bool], timeout: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout} s: {what}")
        await pilot.pause(0.05)
    return time.monotonic() - start


async def wait_ready(pilot, app: StrataDeskApp, timeout: float = 30) -> None:
    await wait_for(pilot, lambda: app.phase == "running" and app.snapshot is not None
                   and app.snapshot.engine.state == "ready", timeout,
                   f"ready (phase {app.phase}, banner {app.banner()[1]!r})")


async def completion(url: str, max_tokens: int, results: list) -> None:
    """One streamed completion; appends ("ok", finish) or ("error", why)."""
    try:
        async with httpx.AsyncClient(timeout=60) as client, client.stream(
            "POST", url + "/v1/completions",
            json={"prompt": "tell me a story", "max_tokens": max_tokens, "stream": True},
        ) as reply:
            if reply.status_code != 200:
                results.append(("error", f"HTTP {reply.status_code}"))
                return
            finish = None
            async for line in reply.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        results.append(("error", chunk["error"]))
                        return
                    for choice in chunk.get("choices") or []:
                        finish = choice.get("finish_reason") or finish
            results.append(("ok", finish) if finish in ("stop", "length") else ("error", f"finish {finish}"))
    except httpx.HTTPError as exc:
        results.append(("error", type(exc).__name__))


async def stop_and_quit(pilot, app: StrataDeskApp) -> None:
    await pilot.press("q")
    await wait_for(pilot, lambda: app.screen.id == "quit", 5, "the quit dialog")
    await pilot.press("s")
    await wait_for(pilot, lambda: not app.is_running, 20, "the app to exit")


# -- tests ----------------------------------------------------------------------------------------


async def test_live_dashboard_follows_server_within_2s(tmp_path: Path) -> None:
    config = hashlm_config(tmp_path)
    app = StrataDeskApp(config_path=config)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: "Starting the server" in screen_text(app) or app.phase == "running", 10,
                       "start-up progress on screen")
        await wait_ready(pilot, app)
        text = screen_text(app)
        assert "ready" in text and app.url in text
        assert "No GPU" in text  # this machine has none; the panel says so
        assert "Slots 0/4 busy" in text
        server = app.server
        assert server is not None and server.running

        results: list = []
        tasks = [asyncio.create_task(completion(server.url, 60, results)) for _ in range(2)]
        started = time.monotonic()
        await wait_for(pilot, lambda: screen_text(app).count("decoding") >= 2, 6, "two decoding slots")
        await wait_for(pilot, lambda: " busy " in screen_text(app), 2, "header busy")
        seen_after = time.monotonic() - started
        assert seen_after < 2.0 + 1.0, f"took {seen_after:.1f} s to show (request start included)"
        # the requests finish: the slots go idle and the table of recent requests fills, within 2 s
        await asyncio.gather(*tasks)
        finished = time.monotonic()
        await wait_for(pilot, lambda: "Slots 0/4 busy" in screen_text(app) and "length" in screen_text(app), 2,
                       "idle again with the finished requests listed")
        assert time.monotonic() - finished < 2.0
        assert [r[0] for r in results] == ["ok", "ok"]

        await pilot.press("c")  # copies the URL (the app's clipboard)
        assert app.clipboard == app.url
        await pilot.press("question_mark")
        await wait_for(pilot, lambda: "strata-desk: keys" in screen_text(app), 3, "help")
        await pilot.press("escape")
        await pilot.press("3")  # digits toggle panels
        assert not app.dashboard.query_one("#gpus").display
        await pilot.press("0")
        assert app.dashboard.query_one("#gpus").display
        await pilot.press("l")
        await wait_for(pilot, lambda: app.screen.id == "logs-screen", 3, "the log screen")
        await wait_for(pilot, lambda: "ready: http://" in screen_text(app), 5, "server log lines")
        await pilot.press("escape")
        await stop_and_quit(pilot, app)
    assert not server.running
    assert app.exit_choice == "stop"


async def test_live_settings_validation(tmp_path: Path) -> None:
    config = hashlm_config(tmp_path, ends=True, tok_s=50)
    app = StrataDeskApp(config_path=config)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        await pilot.press("s")
        await wait_for(pilot, lambda: app.screen.id == "settings", 5, "the settings screen")
        screen = app.screen

        async def set_field(name: str, value: str) -> None:
            field = screen.query_one(f"#in-{name}")
            field.value = value
            await pilot.pause()

        def message(name: str) -> str:
            return str(screen.query_one(f"#set-{name} .setting-msg").content)

        apply_button = screen.query_one("#apply")
        # RunConfig's rules: groups must divide parallel
        await set_field("batch_groups", "3")
        assert "must divide parallel" in message("batch_groups")
        assert apply_button.disabled
        # the engine runs pipelined groups (INFO batch_groups); without a layer split they run in turn
        await set_field("batch_groups", "2")
        assert "not supported by this engine yet" not in message("batch_groups")
        assert message("batch_groups").startswith("no layer split")
        await set_field("batch_groups", "auto")
        assert message("batch_groups").startswith("no layer split")
        assert not apply_button.disabled
        # range and type checks come from RunConfig / the field kind
        await set_field("parallel", "9")
        assert "less than or equal to 8" in message("parallel")
        await set_field("parallel", "two")
        assert "whole number" in message("parallel")
        await set_field("parallel", "4")
        await set_field("adapt_decay", "1.5")
        assert "less than or equal to 1" in message("adapt_decay")
        await set_field("adapt_decay", "0.8")  # valid; without an expert cache it is only kept
        assert message("adapt_decay") == ("kept in the config; no effect: no expert cache (expert-cache empty: "
                                          "every expert stays in memory)")
        # options this engine lacks are shown as such, and their switches cannot be turned on
        assert "not supported by this engine yet" in message("batch_mtp")
        assert message("adapt_async").startswith("kept in the config; no effect: no expert cache")
        assert screen.query_one("#in-batch_mtp").disabled
        assert "1 change(s)" in str(screen.query_one("#settings-summary").content)
        await pilot.press("ctrl+r")  # revert
        await pilot.pause()
        assert "no changes" in str(screen.query_one("#settings-summary").content)
        await pilot.press("escape")
        assert app.screen.id == "dashboard"
        await stop_and_quit(pilot, app)


async def test_live_apply_settings_and_restart(tmp_path: Path) -> None:
    config = hashlm_config(tmp_path, ends=True, tok_s=50)
    app = StrataDeskApp(config_path=config)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        first_pid = app.snapshot.engine.pid
        await pilot.press("s")
        await wait_for(pilot, lambda: app.screen.id == "settings", 5, "settings")
        app.screen.query_one("#in-parallel").value = "2"
        app.screen.query_one("#in-adapt_every").value = "8"
        await pilot.pause()
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.screen.id == "restart", 5, "the apply dialog")
        diff = str(app.screen.query_one("#restart-diff").content)
        assert "parallel" in diff and "adapt_every" in diff and "->" in diff
        await pilot.click("#ok")
        await wait_for(pilot, lambda: app.phase == "restarting", 5, "restarting")
        await wait_for(pilot, lambda: "Restarting the server" in screen_text(app) or app.phase == "running", 5,
                       "restart progress on screen")
        await wait_for(pilot, lambda: app.phase == "running" and app.snapshot is not None
                       and app.snapshot.live.parallel == 2, 30, "the new setting live")
        assert app.snapshot.engine.pid != first_pid
        assert load_config(config).parallel == 2 and load_config(config).adapt_every == 8
        assert load_config(backup_path(config)).parallel == 4  # the .bak keeps the old file
        await wait_for(pilot, lambda: "Slots 0/2 busy" in screen_text(app), 3, "two slots on screen")
        await stop_and_quit(pilot, app)


@pytest.mark.parametrize("mode", ["drain", "now"])
async def test_live_restart_with_requests_in_flight(tmp_path: Path, mode: str) -> None:
    """drain: the request in flight finishes normally, then the restart; now: it ends with an error."""
    config = hashlm_config(tmp_path)
    app = StrataDeskApp(config_path=config)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        results: list = []
        tokens = 100 if mode == "drain" else 2000  # 4 s, or far longer than the test
        task = asyncio.create_task(completion(app.server.url, tokens, results))
        await wait_for(pilot, lambda: app.inflight() > 0, 5, "a request in flight")
        await pilot.press("r")
        await wait_for(pilot, lambda: app.screen.id == "restart", 5, "the restart dialog")
        if mode == "now":
            await pilot.click("#now")
        await pilot.click("#ok")
        if mode == "drain":
            await wait_for(pilot, lambda: app.phase == "draining", 3, "draining")
            await wait_for(pilot, lambda: "Waiting for 1 request" in screen_text(app), 3, "the drain banner")
            await asyncio.wait_for(task, 20)
            assert results == [("ok", "length")]
        else:
            await asyncio.wait_for(task, 20)
            assert results and results[0][0] == "error"
        await wait_ready(pilot, app)
        await stop_and_quit(pilot, app)


async def test_live_failed_start_shows_why_and_restores_backup(tmp_path: Path) -> None:
    good = hashlm_config(tmp_path, ends=True, tok_s=50)
    app = StrataDeskApp(config_path=good, start_timeout=20)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        # a config whose engine cannot start replaces the good one (which becomes the .bak)
        broken = load_config(good).model_copy(update={"engine_command": [
            sys.executable, "-c",
            "import sys; print('strata-engine: cannot load model: tensor blk.0.ffn_gate_exps missing', "
            "file=sys.stderr); sys.exit(3)"]})
        save_config(broken, good)
        app.reload_config()
        await pilot.press("r")
        await wait_for(pilot, lambda: app.screen.id == "restart", 5, "the restart dialog")
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.phase == "failed", 30, "the failed start")
        text = screen_text(app)
        assert " error " in text
        assert "did not start" in text or "could not be started" in text
        assert "restore the previous config (.bak)" in text
        await wait_for(pilot, lambda: "ffn_gate_exps missing" in screen_text(app), 5, "the log tail on screen")
        await pilot.press("u")
        await wait_ready(pilot, app)
        assert "engine.harness" in load_config(good).engine_command
        assert "-c" in (load_config(backup_path(good)).engine_command or [])  # the broken one is kept
        await stop_and_quit(pilot, app)


async def test_live_quit_leave_running_then_attach(tmp_path: Path) -> None:
    config = hashlm_config(tmp_path, ends=True, tok_s=50)
    app = StrataDeskApp(config_path=config)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        url = app.server.url
        pid = app.server.pid
        # the command palette's Quit asks the same question as q
        await pilot.press("ctrl+p")
        await pilot.press(*"quit")
        await pilot.pause(0.5)
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.screen.id == "quit", 5, "the quit dialog from the palette")
        text = screen_text(app)  # the keys on the buttons are shown, not eaten as markup
        assert "Stop the server [s]" in text and "Leave it running [l]" in text and "Cancel [esc]" in text
        await pilot.press("escape")  # cancel: nothing happens
        assert app.is_running and app.screen.id == "dashboard"
        await pilot.press("q")
        await wait_for(pilot, lambda: app.screen.id == "quit", 5, "the quit dialog")
        await pilot.press("enter")  # the focused button: leave it running
        await wait_for(pilot, lambda: not app.is_running, 10, "exit")
    assert app.exit_choice == "leave"
    assert any(r.pid == pid for r in state.find_running())  # left running, on record
    note = app.farewell() or ""  # what run_dashboard prints on the terminal
    assert f"still running at {url}/v1 (pid {pid})" in note and "strata-desk stop hashlm" in note
    assert httpx.get(url + "/health", timeout=5).status_code == 200

    # attach finds it again and, knowing its config, may manage it
    again = StrataDeskApp(attach_url=url)
    async with again.run_test(size=SIZE) as pilot:
        assert again.can_manage
        # one condition: on a loaded machine the header's state may paint a frame before its right side
        await wait_for(pilot, lambda: again.snapshot is not None and shows(again, " ready ", "attached"), 5,
                       "attached and ready")
        await stop_and_quit(pilot, again)
    assert not any(r.pid == pid for r in state.find_running())


async def test_live_attach_to_unknown_server_hides_management(tmp_path: Path) -> None:
    """A server this dashboard has no record of: monitoring only, and quitting leaves it alone."""
    from strata_desk.launcher import ServerProcess

    config = hashlm_config(tmp_path, ends=True, tok_s=50)
    server = ServerProcess(config)
    server.start()
    try:
        await server.wait_ready(30)
        state.forget(server.pid)  # as if someone else started it
        app = StrataDeskApp(attach_url=server.url)
        async with app.run_test(size=SIZE) as pilot:
            assert not app.can_manage
            await wait_for(pilot, lambda: " ready " in screen_text(app), 5, "ready")
            footer = screen_text(app).splitlines()[-2:]
            assert not any("Settings" in line or "Restart" in line for line in footer)
            await pilot.press("s")  # hidden: nothing opens
            await pilot.pause()
            assert app.screen.id == "dashboard"
            await pilot.press("q")
            await wait_for(pilot, lambda: not app.is_running, 5, "exit without asking")
        assert server.running
    finally:
        server.stop(timeout=3)


async def test_live_bench_screen_arms(tmp_path: Path) -> None:
    config = hashlm_config(tmp_path, parallel=1, ends=True, tok_s=0)
    app = StrataDeskApp(config_path=config)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        await pilot.press("b")
        await wait_for(pilot, lambda: app.screen.id == "bench", 5, "the bench screen")
        screen = app.screen
        screen.query_one("#bench-conc").value = "1,2"
        screen.query_one("#bench-tokens").value = "8"
        screen.query_one("#bench-rounds").value = "1"
        screen.query_one("#bench-words").value = "40"
        screen.query_one("#bench-arms").value = "parallel=1; parallel=2"
        await pilot.pause()
        await pilot.press("ctrl+s")
        table = screen.query_one("#bench-table")
        await wait_for(pilot, lambda: table.row_count >= 1, 30, "the first result row")
        await pilot.press("escape")  # back to the dashboard: the bench goes on, the banner says so
        await wait_for(pilot, lambda: "Benchmark running" in screen_text(app), 5, "the bench banner")
        await pilot.press("b")
        assert app.screen is screen
        await wait_for(pilot, lambda: not screen.running, 90, "the bench to finish")
        status = str(screen.query_one("#bench-status").content)
        assert "done" in status, status
        assert table.row_count == 4
        saved = Path(status.split("saved to ")[1].split(" (")[0])
        data = json.loads(saved.read_text())
        assert data["hardware"] and [a["arm"] for a in data["arms"]] == [{"parallel": 1}, {"parallel": 2}]
        assert load_config(config).parallel == 1  # bench restores the config
        await pilot.press("escape")
        await wait_ready(pilot, app)
        await stop_and_quit(pilot, app)


async def test_live_first_run_setup_writes_config_and_starts(tmp_path: Path, tiny_model: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # the written config runs as written (the real engine on the tiny model picked), on a free port
    import strata_desk.setup as setup_mod

    real_build = setup_mod.build_config

    def build(model: Path, parallel=None, context=None):
        config, messages = real_build(model, parallel=parallel, context=context)
        return config.model_copy(update={"port": free_port()}), messages

    monkeypatch.setattr(setup_mod, "build_config", build)
    app = StrataDeskApp()
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.screen.id == "first-run", 5, "the first-run screen")
        field = app.screen.query_one("#fr-path")
        field.value = str(tiny_model)[:-4]  # completion offers the rest
        await wait_for(pilot, lambda: field._suggestion == str(tiny_model), 3, "path completion")
        await pilot.press("right")  # accepts the completion
        assert field.value == str(tiny_model)
        await pilot.press("enter")
        start = app.screen.query_one("#fr-start")
        await wait_for(pilot, lambda: not start.disabled, 20, "setup to finish")
        result = str(app.screen.query_one("#fr-result").content)
        assert "parallel" in result and "no GPU" in result  # the recommendation and its message
        await pilot.click("#fr-start")
        await wait_ready(pilot, app)
        written = paths.config_path_for(tiny_model)
        assert written.is_file() and app.config_path == written.resolve()
        await stop_and_quit(pilot, app)


async def test_live_broken_config_file_restored_from_backup(tmp_path: Path) -> None:
    config = hashlm_config(tmp_path, ends=True, tok_s=50)
    save_config(load_config(config).model_copy(update={"parallel": 2}), config)  # .bak: parallel 4
    config.write_text('{"model": "x.gguf", "parallel": ')  # then the file breaks
    app = StrataDeskApp(config_path=config)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: "The config cannot be used" in screen_text(app), 5, "the config error")
        assert "not valid JSON" in screen_text(app)
        await pilot.press("s")  # no settings on a config that does not load
        await pilot.pause()
        assert app.screen.id == "dashboard"
        await pilot.press("u")
        await wait_ready(pilot, app)
        assert load_config(config).parallel == 4
        assert backup_path(config).read_text().endswith('"parallel": ')  # the broken text is kept as .bak
        await stop_and_quit(pilot, app)


async def test_live_engine_death_is_shown(tmp_path: Path) -> None:
    """An engine that dies under a request: the dashboard shows the error and why; r restarts."""
    config = hashlm_config(tmp_path, tok_s=50, die_after=20)
    app = StrataDeskApp(config_path=config)
    async with app.run_test(size=SIZE) as pilot:
        await wait_ready(pilot, app)
        results: list = []
        await completion(app.server.url, 100, results)
        assert results[0][0] == "error"
        await wait_for(pilot, lambda: "The engine stopped" in screen_text(app), 3, "the engine error banner")
        text = screen_text(app)
        assert " error " in text and "illegal memory access" in text
        await pilot.press("r")
        await wait_for(pilot, lambda: app.screen.id == "restart", 5, "the restart dialog")
        await pilot.press("enter")
        await wait_ready(pilot, app)
        assert "The engine stopped" not in screen_text(app)
        await stop_and_quit(pilot, app)
