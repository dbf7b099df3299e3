"""Unit tests of the dashboard's pure parts: formatting, bar splitting, the view rules (state, dense,
supported options, solo path), history, log tailing, path completion, settings error mapping,
and the client against a stand-in transport; the CPU measuring command's arguments and report; screens
using only Textual's App API."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from server.config import RunConfig
from server.metrics_schema import EngineView, LiveView
from server.urls import api_url
from tui import preview
from tui.client import FixedSource, MetricsClient, PollError
from tui.cpu_use import Window, parse_size, report
from tui.format import duration, rate, spark, spark_rows
from tui.logs import FileTail, LogBuffer
from tui.screens.restart import diff_text
from tui.screens.settings import divisors, field_errors
from tui.view import (
    History,
    dash_state,
    has_tier_data,
    is_dense,
    solo_active,
    solo_tok_s,
    supported_options,
    unsupported_options,
)
from tui.widgets.gpu_card import gpu_segments, gpu_title
from tui.widgets.path_suggester import PathSuggester
from tui.widgets.segment_bar import split_cells


def test_format_helpers() -> None:
    assert duration(3.21) == "3.2s" and duration(75) == "1m15s" and duration(7300) == "2h01m"
    assert duration(None) == "-" and rate(1234.5) == "1,234" and rate(42.25) == "42.2"
    assert spark([0, 1, 2, 4], 4) == "▁▃▅█" and spark([], 3) == "   "
    rows = spark_rows([0, 4, 8], 3, height=2)
    assert len(rows) == 2 and rows[0][2] == "█" and rows[1][2] == "█" and rows[0][1] == " "
    assert spark_rows([0, 0], 4, height=2)[-1] == "  ▁▁"  # a flat line at zero


def test_split_cells_fills_width_and_keeps_small_parts_visible() -> None:
    cells = split_cells([1000, 1, 0, 500], 40)
    assert sum(cells) == 40 and cells[1] == 1 and cells[2] == 0
    assert split_cells([0, 0], 10) == [0, 0]


def test_gpu_segments_split_and_unaccounted_memory() -> None:
    gpu = preview.busy().devices[0]
    labels = [s.label for s in gpu_segments(gpu)]
    assert labels == ["weights", "experts", "slots", "KV", "other", "free"]
    gpu.split.other_mib = None  # derived from NVML's total when the engine does not say
    other = next(s for s in gpu_segments(gpu) if s.label == "other")
    assert other.value == pytest.approx(gpu.total_mib - gpu.split.free_mib - 2310 - 15872 - 2240 - 872)
    gpu.split = None
    assert [s.label for s in gpu_segments(gpu)] == ["used", "free"]


def test_each_card_names_its_stages_layers() -> None:
    from server.metrics import stage_layers

    assert stage_layers("0-23@cuda:0,24-47@cuda:1") == {0: "0-23", 1: "24-47"}
    assert stage_layers("-") == {} and stage_layers(None) == {} and stage_layers("0-3@cpu,4-7@cpu") == {}
    gpu = preview.busy().devices[0]
    assert "layers" not in gpu_title(gpu).plain  # no split
    gpu.split.layers = "0-23"
    assert "GiB  layers 0-23  util" in gpu_title(gpu).plain


def test_supported_options_from_info_keys() -> None:
    assert supported_options(EngineView(info={"batch_groups": 1, "batch_slots": 4})) == set()
    assert supported_options(EngineView(info={"unsupported": "batch_mtp,adapt_async,pcie_frac"})) == {"batch_groups"}
    assert supported_options(EngineView(info={"unsupported": ""})) == {"batch_mtp", "batch_groups"}
    assert unsupported_options(EngineView(info={"unsupported": "batch_mtp,pcie_frac"})) == {"batch_mtp", "pcie_frac"}
    assert supported_options(None) == set()


def test_dense_and_tier_states() -> None:
    assert is_dense(preview.cpu_dense())
    moe = preview.idle()
    assert not is_dense(moe) and has_tier_data(moe)
    moe.tier = None
    moe.stats = None
    assert not is_dense(moe) and not has_tier_data(moe)  # no data yet
    moe.engine.info = {"experts": 0}  # the engine says the model is dense
    assert is_dense(moe)


def test_dash_state_rules() -> None:
    idle, busy, dead = preview.idle(), preview.busy(), preview.dead()
    assert dash_state(idle, starting=False, failed=False, reachable=True) == "ready"
    assert dash_state(busy, starting=False, failed=False, reachable=True) == "busy"
    assert dash_state(dead, starting=False, failed=False, reachable=True) == "error"
    assert dash_state(None, starting=True, failed=False, reachable=False) == "loading"
    assert dash_state(idle, starting=False, failed=True, reachable=True) == "error"
    assert dash_state(idle, starting=False, failed=False, reachable=False) == "error"


def test_solo_path_detection() -> None:
    solo = LiveView(state="generating", running=1, parallel=1, tok_s=80.0)
    assert solo_active(solo) and solo_tok_s(solo) == 80.0
    busy = preview.busy().live
    assert not solo_active(busy)
    busy.running = 4  # three slots busy... plus one request alone on the solo path
    busy.slots[2].state = "idle"
    assert solo_active(busy)
    assert solo_tok_s(busy) == pytest.approx(max(0.0, busy.tok_s - (47.2 + 45.9 + 44.6)))


def test_history_is_bounded() -> None:
    history = History()
    for snap in preview.busy_history() * 2:
        history.push(snap)
    assert len(history.total) == 60 and len(history.slot(0)) == 20
    assert history.prefill[-1] == 2310.0  # a slot reading counts as prefill


def test_log_buffer_and_file_tail(tmp_path: Path) -> None:
    buf = LogBuffer(size=3)
    for i in range(5):
        buf.add("server", f"line {i}")
    assert [line.text for line in buf.since(0)] == ["line 2", "line 3", "line 4"]
    assert buf.since(buf.seq) == []

    log = tmp_path / "x.log"
    log.write_text("old\n")
    tail = FileTail(log, "engine")
    assert tail.read() == ["old"]
    with open(log, "a") as fh:
        fh.write("one\ntw")
    assert tail.read() == ["one"]
    with open(log, "a") as fh:
        fh.write("o\n")
    assert tail.read() == ["two"]
    log.write_text("fresh\n")  # truncated / rotated: starts over
    os.utime(log)
    assert tail.read() == ["fresh"]
    assert FileTail(tmp_path / "missing.log", "engine").read() == []


def test_log_buffer_times_and_no_engine_echo() -> None:
    """The server's lines carry their time; its start-up echo of the engine's lines (which the engine
    log has too) is dropped; the dashboard's own lines are stamped when said."""
    buf = LogBuffer()
    buf.add("server", "09:14:02 [strata] engine: loading blk.0")
    buf.add("engine", "09:14:02 loading blk.0")
    buf.add("server", "09:14:43 [strata] 404 GET /nope from 127.0.0.1 in 1 ms")
    buf.add("server", "INFO: a line uvicorn wrote")
    buf.add("desk", "ready")
    lines = buf.since(0)
    assert [(line.source, line.time, line.text) for line in lines[:3]] == [
        ("engine", "09:14:02", "loading blk.0"),
        ("server", "09:14:43", "404 GET /nope from 127.0.0.1 in 1 ms"),
        ("server", "", "INFO: a line uvicorn wrote")]
    assert re.fullmatch(r"\d\d:\d\d:\d\d", lines[3].time)


def test_path_suggester_completes_dirs_and_gguf(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "qwen.gguf").touch()
    (tmp_path / "models" / "notes.txt").touch()
    suggest = PathSuggester()
    run = asyncio.run
    assert run(suggest.get_suggestion(str(tmp_path / "mo"))) == str(tmp_path / "models") + os.sep
    assert run(suggest.get_suggestion(str(tmp_path / "models" / "q"))) == str(tmp_path / "models" / "qwen.gguf")
    assert run(suggest.get_suggestion(str(tmp_path / "models" / "n"))) is None  # not a .gguf


def test_settings_errors_map_to_the_option_named() -> None:
    with pytest.raises(ValidationError) as err:
        RunConfig.model_validate({"model": "m.gguf", "parallel": 4, "batch_groups": 3})
    assert "must divide" in field_errors(err.value, ["parallel", "batch_groups"])["batch_groups"]
    with pytest.raises(ValidationError) as err:
        RunConfig.model_validate({"model": "m.gguf", "parallel": 12})
    assert "parallel" in field_errors(err.value, ["parallel", "batch_groups"])
    assert divisors(8) == [1, 2, 4, 8]
    assert "->" in diff_text([("parallel", 4, 2)]).plain


def test_client_reads_metrics_and_reports_errors() -> None:
    body = preview.idle().model_dump_json()

    def handler(request: httpx.Request) -> httpx.Response:
        if request.headers.get("authorization") != "Bearer k":
            return httpx.Response(401)
        return httpx.Response(200, text=body)

    async def go() -> None:
        client = MetricsClient("http://x:1/", api_key="k")
        client._http = httpx.AsyncClient(base_url="http://x:1", transport=httpx.MockTransport(handler),
                                         headers={"Authorization": "Bearer k"})
        snap = await client.fetch()
        assert snap.engine.model == "Qwen3-30B-A3B-Q4_K_M"
        client._http.headers.pop("Authorization")
        with pytest.raises(PollError, match="API key"):
            await client.fetch()
        await client.aclose()
        nobody = MetricsClient("http://127.0.0.1:9", timeout=0.5)
        with pytest.raises(PollError, match="cannot connect"):
            await nobody.fetch()
        await nobody.aclose()
        fixed = FixedSource(fail="down")
        with pytest.raises(PollError, match="down"):
            await fixed.fetch()

    asyncio.run(go())
    assert api_url("http://h:8080/") == "http://h:8080/v1"


def test_cpu_use_size_and_report() -> None:
    assert parse_size("120x40") == (120, 40)
    for bad in ("120", "x40", "10x5", "wide"):
        with pytest.raises(argparse.ArgumentTypeError, match="COLUMNSxROWS"):
            parse_size(bad)
    idle, busy = Window("idle", 0.6, 20.0, 0.05), Window("busy", 2.4, 20.0, 0.10, requests=8)
    assert idle.ok and not busy.ok and busy.share == pytest.approx(0.12)
    text = report([idle, busy])
    assert "idle    3.0%  bound 5%  ok" in text
    assert "busy   12.0%  bound 10%  ABOVE" in text and "8 completions finished" in text


def test_screens_use_only_textuals_app_api() -> None:
    """Screens get their data through messages, reactives and their arguments: `self.app.X` in a
    screen may only be Textual's own App API (push_screen, notify, post_message ...), never one of
    the dashboard's attributes."""
    import ast

    from textual.app import App

    screens = Path(__file__).resolve().parent.parent / "tui" / "screens"
    reaches = []
    for path in sorted(screens.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "app"
                    and isinstance(node.value.value, ast.Name) and node.value.value.id == "self"
                    and not hasattr(App, node.attr)):
                reaches.append(f"{path.name}:{node.lineno} self.app.{node.attr}")
    assert reaches == []
