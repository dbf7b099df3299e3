"""strata_desk.bench: statistics, prompts, the table, and runs against a live server.

The live runs use a stand-in OpenAI server (starlette + uvicorn, below) that streams a few tokens
and reports the config's `parallel` in /metrics, started through `ServerProcess` so the arms'
rewrite-restart-measure loop is exercised end to end; one more test runs bench against the real
server and engine on a HashLM model.
"""

from __future__ import annotations

import json
import re
import sys
import textwrap

import pytest

from engine.hashlm import write_hashlm
from server.config import RunConfig, load_config, save_config
from strata_desk import paths
from strata_desk.bench import (
    BenchError,
    BenchResult,
    BenchRow,
    BenchSpec,
    RequestResult,
    RoundResult,
    build_prompt,
    format_table,
    parse_arm,
    run_bench,
    setting_label,
)
from strata_desk.bench.run import compare
from strata_desk.bench.stats import bootstrap_ratio_ci, median
from strata_desk.cli import main
from strata_desk.launcher import ServerProcess

OPENAI_STAND_IN = textwrap.dedent('''
    import asyncio, json, sys, time
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    config_path, port = sys.argv[1], int(sys.argv[2])
    config = json.load(open(config_path))
    parallel = config.get("parallel", 1)

    async def health(request):
        return JSONResponse({"status": "ok"})

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "stand-in", "object": "model"}]})

    async def metrics(request):
        return JSONResponse({"config": {"parallel": parallel}, "devices": [], "host": {"cpu_count": 2}})

    async def chat(request):
        body = await request.json()
        n = body["max_tokens"]
        assert body["stream"] and body["temperature"] == 0
        assert body["chat_template_kwargs"] == {"enable_thinking": False}

        async def events():
            await asyncio.sleep(0.01)
            for i in range(n):
                chunk = {"choices": [{"index": 0, "delta": {"content": f"w{i} "}}]}
                yield f"data: {json.dumps(chunk)}\\n\\n"
                await asyncio.sleep(0.002 * parallel)
            yield 'data: {"choices": [], "usage": {"completion_tokens": %d}}\\n\\n' % n
            yield "data: [DONE]\\n\\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/health", health), Route("/v1/models", models),
                            Route("/metrics", metrics), Route("/v1/chat/completions", chat, methods=["POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
''')


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv(paths.HOME_ENV, str(tmp_path / "home"))


# -- statistics --------------------------------------------------------------------------------


def test_median():
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([1.0, 2.0, 3.0, 4.0]) == 2.5
    assert median([]) != median([])  # NaN


def test_bootstrap_is_deterministic_and_brackets_the_ratio():
    base = [70.0, 72.0, 71.0, 69.5, 70.5]
    arm = [80.0, 83.0, 81.0, 79.0, 82.0]
    one = bootstrap_ratio_ci(arm, base)
    two = bootstrap_ratio_ci(arm, base)
    assert one == two
    assert one.ratio == pytest.approx(81.0 / 70.5)
    assert one.low <= one.ratio <= one.high
    assert 1.0 < one.low  # clearly faster
    assert one.percent.startswith("+14.9% (95% CI +")


def test_bootstrap_identical_samples():
    ci = bootstrap_ratio_ci([5.0, 5.0, 5.0], [5.0, 5.0, 5.0])
    assert (ci.ratio, ci.low, ci.high) == (1.0, 1.0, 1.0)
    with pytest.raises(ValueError):
        bootstrap_ratio_ci([], [1.0])


def test_bootstrap_seed_changes_interval_only():
    a, b = [1.0, 2.0, 3.0, 4.0], [2.0, 2.5, 3.0, 3.5]
    ci0 = bootstrap_ratio_ci(a, b, seed=1)
    ci1 = bootstrap_ratio_ci(a, b, seed=2)
    assert ci0.ratio == ci1.ratio


# -- pieces --------------------------------------------------------------------------------------


def test_parse_arm_and_label():
    assert parse_arm("parallel=2") == {"parallel": 2}
    assert parse_arm("parallel=2, batch_mtp=true,batch_groups=auto") == {
        "parallel": 2, "batch_mtp": True, "batch_groups": "auto"}
    with pytest.raises(BenchError):
        parse_arm("parallel")
    assert setting_label({"parallel": 1}) == "one at a time"
    assert setting_label({"parallel": 2}) == '"parallel": 2'


def test_prompts_are_distinct_and_sized():
    prompts = {build_prompt(i, 800, "r0-") for i in range(8)}
    assert len(prompts) == 8
    assert build_prompt(3, 800, "x") == build_prompt(3, 800, "x")
    assert 780 <= len(build_prompt(0, 800).split()) <= 830


def test_round_figures():
    rnd = RoundResult([RequestResult(tokens=11, first_s=0.5, end_s=1.5),
                       RequestResult(tokens=11, first_s=1.0, end_s=2.5),
                       RequestResult(error="HTTP 503")])
    assert rnd.total_tok_s == pytest.approx(22 / 2.5)
    assert rnd.per_request_tok_s == pytest.approx((10 / 1.0 + 10 / 1.5) / 2)
    assert rnd.ttft == [0.5, 1.0]


def test_format_table_like_the_seed():
    def row(arm, setting, c, totals):
        r = BenchRow(arm, setting, c, [RoundResult([RequestResult(tokens=int(t * 2) + 1, first_s=0.4,
                                                                  end_s=2.0)]) for t in totals])
        return r
    result = BenchResult(spec={}, arms=[{"setting": "one at a time"}, {"setting": '"parallel": 2'}])
    base = row(0, "one at a time", 1, [74.0, 75.0, 73.0])
    arm = row(1, '"parallel": 2', 1, [67.0, 68.0, 66.0])
    result.rows = [base, arm]
    compare(result, arm)
    table = format_table(result)
    lines = table.splitlines()
    assert lines[0] == ("| Concurrent | Setting | Total tok/s | vs one at a time | Per request tok/s "
                        "| First token: median / last of the round |")
    assert lines[2].startswith("| 1 | one at a time | ") and "| - |" in lines[2]
    assert '| 1 | "parallel": 2 |' in lines[3] and "-9 %" in lines[3]
    assert "400 ms / 400 ms" in lines[2]
    assert "95% CI" in table


def test_first_tokens_in_milliseconds_below_a_second():
    """A GPU's first tokens take tens of milliseconds: shown as such, seconds from one second, "-" where none came."""
    requests = [RequestResult(tokens=3, first_s=0.0234, end_s=2.0), RequestResult(tokens=3, first_s=1.53, end_s=2.0)]
    assert BenchRow(0, "x", 2, [RoundResult(requests)]).first_token_text == "777 ms / 1.5 s"
    assert BenchRow(0, "x", 1, [RoundResult(requests[:1])]).first_token_text == "23 ms / 23 ms"
    assert BenchRow(0, "x", 1, []).first_token_text == "- / -"


def test_each_concurrency_against_the_same_setting_one_at_a_time():
    """What the issue's target counts: 8 at once against one at a time, as a ratio of medians with its
    interval, for every arm; kept up to date when concurrency 1 runs after the others."""
    def row(arm, c, totals):
        return BenchRow(arm, "x", c, [RoundResult([RequestResult(tokens=int(t * 2), first_s=0.1, end_s=2.0)])
                                      for t in totals])
    result = BenchResult(spec={}, arms=[{"setting": "x"}])
    together = row(0, 8, [300.0, 320.0, 310.0])
    result.rows = [together]
    compare(result, together)
    assert together.versus_alone is None  # no concurrency 1 yet
    alone = row(0, 1, [100.0, 101.0, 99.0])
    result.rows.append(alone)
    compare(result, alone)
    assert alone.versus_alone is None and together.versus_alone.ratio == pytest.approx(310.0 / 100.0)
    assert together.versus_alone.low <= together.versus_alone.ratio <= together.versus_alone.high
    table = format_table(result)
    assert "against the same setting one request at a time" in table
    assert re.search(r"^  8 concurrent, x: 3\.10x \(95% CI \d\.\d\dx to \d\.\d\dx\)$", table, re.M), table
    assert result.rows[0].to_dict()["versus_alone"]["ratio"] == pytest.approx(3.1)


def test_spec_errors(capsys):
    assert main(["bench", "--url", "http://127.0.0.1:9", "--concurrency", "1,x"]) == 2
    assert "--concurrency" in capsys.readouterr().err
    assert main(["bench", "--url", "http://127.0.0.1:9", "--arms", "parallel=2"]) == 2
    assert "--arms needs --config" in capsys.readouterr().err
    assert main(["bench", "--url", "http://127.0.0.1:9", "--rounds", "1", "--concurrency", "1"]) == 2
    assert "no server at" in capsys.readouterr().err


# -- live --------------------------------------------------------------------------------------


@pytest.fixture
def openai_stand_in(tmp_path, monkeypatch):
    """Every ServerProcess runs the stand-in OpenAI server with its config and port."""
    script = tmp_path / "openai_stand_in.py"
    script.write_text(OPENAI_STAND_IN)

    def command(self):
        return [sys.executable, str(script), str(self.config_path), str(self._listen()[1])]

    monkeypatch.setattr(ServerProcess, "command", command)
    from ports import free_port

    config = save_config(RunConfig(model=str(tmp_path / "m.gguf"), port=free_port()),
                         tmp_path / "strata-m.json")
    yield config
    from strata_desk.launcher import find_running

    for record in find_running():
        ServerProcess.adopt(record).stop(timeout=3)


async def test_bench_against_a_running_server(openai_stand_in, tmp_path):
    proc = ServerProcess(openai_stand_in)
    proc.start()
    try:
        await proc.wait_ready(30)
        seen: list[int] = []
        spec = BenchSpec(url=proc.url, concurrency=[1, 3], max_tokens=12, rounds=2, prompt_words=40,
                         out=tmp_path / "out.json")
        result = await run_bench(spec, lambda row: seen.append(row.concurrency))
    finally:
        proc.stop()
    assert seen == [1, 1, 3, 3]
    assert [(r.concurrency, len(r.rounds), r.errors) for r in result.rows] == [(1, 2, 0), (3, 2, 0)]
    assert all(len(rnd.requests) == 3 and rnd.ok[0].tokens == 12 for rnd in result.rows[1].rounds)
    assert result.rows[1].ttft_last_s >= result.rows[1].ttft_median_s > 0
    assert result.rows[0].total_tok_s > 0
    saved = json.loads((tmp_path / "out.json").read_text())
    assert saved["arms"][0]["setting"] == "one at a time"
    assert "ram_gib" in saved["hardware"] and saved["rows"][1]["concurrency"] == 3
    assert "| 3 | one at a time |" in format_table(result)


async def test_bench_arms_rewrite_restart_and_restore(openai_stand_in, tmp_path):
    statuses: list[str] = []
    spec = BenchSpec(config=openai_stand_in, concurrency=[2], max_tokens=8, rounds=2, prompt_words=20,
                     arms=[{"parallel": 1}, {"parallel": 2}], ready_timeout=30)
    result = await run_bench(spec, on_status=statuses.append)
    assert [a["server"]["config"]["parallel"] for a in result.arms] == [1, 2]  # restarted with each arm
    base, arm = sorted(result.rows, key=lambda r: r.arm)
    assert base.setting == "one at a time" and arm.setting == '"parallel": 2'
    assert base.versus_first is None and arm.versus_first is not None
    assert load_config(openai_stand_in).parallel == 1  # the original config is back
    from strata_desk.launcher import find_running

    assert find_running() == []  # bench started the server, so bench stopped it
    assert any("restarting" in s for s in statuses)
    table = format_table(result)
    assert "vs one at a time" in table and "95% CI" in table


async def test_bench_arms_reject_bad_keys(openai_stand_in):
    from server.config import ConfigError

    spec = BenchSpec(config=openai_stand_in, concurrency=[1], arms=[{"parallel": 1}, {"nonsense": 3}])
    with pytest.raises(ConfigError, match="nonsense"):
        await run_bench(spec)
    assert load_config(openai_stand_in).parallel == 1


async def test_bench_real_server_and_engine(tmp_path):
    from ports import free_port

    config = save_config(RunConfig(model=str(write_hashlm(tmp_path / "hashlm.gguf")), port=free_port(),
                                   tokenizer="bytes", device="cpu", log=str(tmp_path / "engine.log")),
                         tmp_path / "strata-hashlm.json")
    spec = BenchSpec(config=config, concurrency=[1, 2], max_tokens=8, rounds=2, prompt_words=30,
                     arms=[{"parallel": 1}, {"parallel": 2}], ready_timeout=60)
    result = await run_bench(spec)
    assert len(result.rows) == 4 and all(r.errors == 0 for r in result.rows)
    assert all(r.total_tok_s > 0 for r in result.rows)
