"""Running a benchmark: the table (every concurrency, every round) against one server, once or once
per arm (`arms.arm_servers`), each arm compared with the first."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import httpx

from server.config import load_config
from strata_desk.bench.arms import arm_servers
from strata_desk.bench.client import client_for, model_id, one_request, run_round, server_view
from strata_desk.bench.prompts import build_prompt
from strata_desk.bench.results import BenchResult, BenchRow
from strata_desk.bench.spec import BenchError, BenchSpec, setting_label
from strata_desk.bench.stats import RatioCI, bootstrap_ratio_ci
from strata_desk.launcher import call_back


async def _run_table(spec: BenchSpec, url: str, key: str | None, arm_index: int, arm: dict[str, Any],
                     result: BenchResult, on_result: Callable[[BenchRow], Any] | None) -> None:
    async with client_for(url, key, spec.request_timeout) as client:
        try:
            model = await model_id(client)
        except httpx.HTTPError as exc:
            raise BenchError(f"no server at {url} ({type(exc).__name__}: {exc})") from None
        view = await server_view(client)
        if not arm:  # no arms: label the server as it runs
            parallel = (view.get("config") or {}).get("parallel") or 1
            arm = {"parallel": parallel}
        result.arms.append({"arm": arm, "setting": setting_label(arm), "model": model, "server": view})
        if spec.warmup:
            await one_request(client, model, build_prompt(0, 20, "warmup"), 8, time.monotonic())
        for concurrency in spec.concurrency:
            row = BenchRow(arm_index, setting_label(arm), concurrency)
            result.rows.append(row)
            for round_index in range(spec.rounds):
                salt = f"a{arm_index}c{concurrency}r{round_index}-"
                row.rounds.append(await run_round(client, model, spec, concurrency, salt))
                compare(result, row)
                await call_back(on_result, row)
            if row.errors == concurrency * spec.rounds:
                first = next(r.error for rnd in row.rounds for r in rnd.requests if r.error)
                raise BenchError(f"every request failed at concurrency {concurrency}: {first}")


def compare(result: BenchResult, row: BenchRow) -> None:
    """`row.versus_first`: its rounds' total tok/s against the first arm's at the same concurrency; and
    `versus_alone` of its arm's rows: against the arm's concurrency 1 (kept up to date as rounds come in)."""
    def ratio(of: BenchRow, base: BenchRow | None) -> RatioCI | None:
        if base is None or not base.totals or not of.totals or base.total_tok_s <= 0:
            return None
        return bootstrap_ratio_ci(of.totals, base.totals)

    if row.arm != 0:
        row.versus_first = ratio(row, next((r for r in result.rows if r.arm == 0 and r.concurrency == row.concurrency),
                                           None))
    arm = [r for r in result.rows if r.arm == row.arm]
    alone = next((r for r in arm if r.concurrency == 1), None)
    for r in arm:
        if r is not alone:
            r.versus_alone = ratio(r, alone)


async def run_bench(
    spec: BenchSpec,
    on_result: Callable[[BenchRow], Any] | None = None,
    *,
    server: Any = None,
    on_status: Callable[[str], Any] | None = None,
) -> BenchResult:
    """Run the benchmark. `on_result(row)` (sync or async) is called after every round with the row
    so far; `on_status(text)` gets progress lines (restarts, loading). With arms, `server` may be
    the caller's `launcher.ServerProcess` (the dashboard's); otherwise bench starts or adopts one."""
    from strata_desk.probe import probe_hardware

    result = BenchResult(spec=_spec_dict(spec), hardware=probe_hardware().to_dict())
    if not spec.arms:
        url, key = _target(spec)
        await _run_table(spec, url, key, 0, {}, result, on_result)
    else:
        async with contextlib.aclosing(arm_servers(spec, server, on_status)) as arms:
            async for target in arms:
                await _run_table(spec, target.url, target.key, target.index, target.arm, result, on_result)
    result.finished = time.time()
    if spec.out:
        result.save(spec.out)
    return result


def _target(spec: BenchSpec) -> tuple[str, str | None]:
    key = spec.key
    url = spec.url
    if spec.config is not None:
        config = load_config(spec.config)
        key = key or config.api_key
        if url is None:
            from server.urls import server_url

            url = server_url(config.host, config.port)
    if url is None:
        raise BenchError("no server: give --url URL or --config FILE")
    return url.rstrip("/"), key


def _spec_dict(spec: BenchSpec) -> dict[str, Any]:
    out = asdict(spec)
    out["config"] = str(spec.config) if spec.config else None
    out["out"] = str(spec.out) if spec.out else None
    out["key"] = "(set)" if spec.key else None
    return out


