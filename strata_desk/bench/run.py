"""`strata-desk bench`: C different requests at once against a running server, the seed's table,
and A/B arms (rewrite the config, restart the server, run the table again, compare with the first).

Each request is a distinct essay prompt built from a word list, decoded greedily and streamed so the
first token's time is measured. For every (arm, concurrency) the rounds are summarised by medians:

- Total tok/s: the round's generated tokens / the time from sending to the last reply's end;
- Per request tok/s: each request's decode rate (tokens after the first / time after the first
  token), averaged over the round's requests;
- First token: the median request's and the last request's time to first token.

Arms are compared with the first arm by the ratio of the medians of the rounds' total tok/s and a
95% percentile-bootstrap interval (`bench_stats`). The dashboard's bench screen calls
`run_bench(spec, on_result)`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from server.config import load_config
from strata_desk.bench_stats import RatioCI, bootstrap_ratio_ci, median
from strata_desk.bench_words import TOPICS, WORDS
from strata_desk.launcher import call_back


class BenchError(RuntimeError):
    """The benchmark cannot run (no server, bad arm, every request failed)."""


# -- the spec ------------------------------------------------------------------------------------


@dataclass
class BenchSpec:
    url: str | None = None  # default: the config's host and port
    concurrency: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    max_tokens: int = 256
    rounds: int = 3
    prompt_words: int = 800
    key: str | None = None  # default: the config's api_key
    arms: list[dict[str, Any]] = field(default_factory=list)  # e.g. [{"parallel": 1}, {"parallel": 2}]
    config: Path | None = None  # needed for arms
    out: Path | None = None
    request_timeout: float = 600.0
    ready_timeout: float = 900.0
    warmup: bool = True  # one short request before each arm's table, not counted
    thinking: bool = False  # sends chat_template_kwargs.enable_thinking (off, as the seed measured)


def parse_arm(text: str) -> dict[str, Any]:
    """`"parallel=2"` or `"parallel=2,batch_mtp=true"` -> {"parallel": 2, "batch_mtp": True}."""
    arm: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise BenchError(f"arm {text!r}: expected key=value[,key=value] (e.g. parallel=2)")
        try:
            arm[key.strip()] = json.loads(value)
        except ValueError:
            arm[key.strip()] = value.strip()
    if not arm:
        raise BenchError(f"arm {text!r} is empty")
    return arm


def parse_concurrency(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise BenchError(f"--concurrency {text!r}: expected numbers like 1,2,4,8") from None
    if not values or min(values) < 1:
        raise BenchError(f"--concurrency {text!r}: each value must be 1 or more")
    return values


def setting_label(arm: dict[str, Any]) -> str:
    if set(arm) == {"parallel"} and arm["parallel"] == 1:
        return "one at a time"
    return ", ".join(f'"{k}": {json.dumps(v)}' for k, v in sorted(arm.items()))


def build_prompt(index: int, words: int, salt: str = "") -> str:
    """A distinct essay request of about `words` words (deterministic in index and salt)."""
    rng = random.Random(f"strata-bench-{salt}-{index}")
    topic = TOPICS[index % len(TOPICS)]
    notes = " ".join(rng.choice(WORDS) for _ in range(max(0, words - 20)))
    return (f"Write an essay about {topic}. Use these notes as loose inspiration, in any order "
            f"(request {salt}{index}): {notes}")


# -- results ---------------------------------------------------------------------------------


@dataclass
class RequestResult:
    tokens: int = 0
    first_s: float | None = None  # time to the first token, from the round's start
    end_s: float = 0.0
    error: str | None = None

    @property
    def decode_tok_s(self) -> float | None:
        if self.first_s is None or self.tokens < 2 or self.end_s <= self.first_s:
            return None
        return (self.tokens - 1) / (self.end_s - self.first_s)


@dataclass
class RoundResult:
    requests: list[RequestResult]

    @property
    def ok(self) -> list[RequestResult]:
        return [r for r in self.requests if r.error is None]

    @property
    def total_tok_s(self) -> float:
        ok = self.ok
        wall = max((r.end_s for r in ok), default=0.0)
        return sum(r.tokens for r in ok) / wall if wall > 0 else 0.0

    @property
    def per_request_tok_s(self) -> float:
        rates = [r.decode_tok_s for r in self.ok if r.decode_tok_s is not None]
        return sum(rates) / len(rates) if rates else 0.0

    @property
    def ttft(self) -> list[float]:
        return [r.first_s for r in self.ok if r.first_s is not None]

    def to_dict(self) -> dict[str, Any]:
        return {"total_tok_s": self.total_tok_s, "per_request_tok_s": self.per_request_tok_s,
                "requests": [asdict(r) for r in self.requests]}


@dataclass
class BenchRow:
    arm: int
    setting: str
    concurrency: int
    rounds: list[RoundResult] = field(default_factory=list)
    versus_first: RatioCI | None = None  # this arm against arm 0 at the same concurrency

    @property
    def totals(self) -> list[float]:
        return [r.total_tok_s for r in self.rounds]

    @property
    def total_tok_s(self) -> float:
        return median(self.totals)

    @property
    def per_request_tok_s(self) -> float:
        return median([r.per_request_tok_s for r in self.rounds])

    @property
    def ttft_median_s(self) -> float:
        return median([median(r.ttft) for r in self.rounds if r.ttft])

    @property
    def ttft_last_s(self) -> float:
        return median([max(r.ttft) for r in self.rounds if r.ttft])

    @property
    def errors(self) -> int:
        return sum(len(r.requests) - len(r.ok) for r in self.rounds)

    def to_dict(self) -> dict[str, Any]:
        out = {"arm": self.arm, "setting": self.setting, "concurrency": self.concurrency,
               "total_tok_s": self.total_tok_s, "per_request_tok_s": self.per_request_tok_s,
               "ttft_median_s": self.ttft_median_s, "ttft_last_s": self.ttft_last_s,
               "errors": self.errors, "rounds": [r.to_dict() for r in self.rounds]}
        if self.versus_first is not None:
            out["versus_first"] = asdict(self.versus_first)
        return out


@dataclass
class BenchResult:
    spec: dict[str, Any]
    rows: list[BenchRow] = field(default_factory=list)
    arms: list[dict[str, Any]] = field(default_factory=list)  # per arm: its setting and the server's view
    hardware: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.time)
    finished: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"spec": self.spec, "started": self.started, "finished": self.finished,
                "hardware": self.hardware, "arms": self.arms, "rows": [r.to_dict() for r in self.rows]}

    def save(self, path: Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2, default=str) + "\n", encoding="utf-8")
        return path


# -- talking to the server -------------------------------------------------------------------


async def _one_request(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int,
                       t0: float, thinking: bool = False) -> RequestResult:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "chat_template_kwargs": {"enable_thinking": thinking}}
    result = RequestResult()
    counted = 0
    usage_tokens = None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as reply:
            if reply.status_code != 200:
                text = (await reply.aread()).decode(errors="replace")[:200]
                result.error = f"HTTP {reply.status_code}: {text}"
                result.end_s = time.monotonic() - t0
                return result
            async for line in reply.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if delta.get("content") or delta.get("reasoning_content"):
                        counted += 1
                        if result.first_s is None:
                            result.first_s = time.monotonic() - t0
    except (httpx.HTTPError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.end_s = time.monotonic() - t0
    result.tokens = int(usage_tokens) if usage_tokens is not None else counted
    return result


async def _run_round(client: httpx.AsyncClient, model: str, spec: BenchSpec, concurrency: int,
                     salt: str) -> RoundResult:
    prompts = [build_prompt(i, spec.prompt_words, salt) for i in range(concurrency)]
    t0 = time.monotonic()
    results = await asyncio.gather(*(_one_request(client, model, p, spec.max_tokens, t0, spec.thinking)
                                     for p in prompts))
    return RoundResult(list(results))


async def _get_json(client: httpx.AsyncClient, path: str) -> dict[str, Any]:
    try:
        reply = await client.get(path)
        return reply.json() if reply.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}


async def _server_view(client: httpx.AsyncClient) -> dict[str, Any]:
    metrics = await _get_json(client, "/metrics")
    status = await _get_json(client, "/v1/status")
    return {"config": metrics.get("config"), "devices": metrics.get("devices"), "host": metrics.get("host"),
            "engine": metrics.get("engine"), "status": status}


async def _model_id(client: httpx.AsyncClient) -> str:
    reply = await client.get("/v1/models")
    if reply.status_code == 401:
        raise BenchError("the server wants an API key (--key)")
    reply.raise_for_status()
    data = reply.json().get("data") or []
    if not data:
        raise BenchError("the server lists no model")
    return str(data[0]["id"])


def _client(url: str, key: str | None, timeout: float) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.AsyncClient(base_url=url, headers=headers,
                             timeout=httpx.Timeout(timeout, connect=10.0),
                             limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))


async def _run_table(spec: BenchSpec, url: str, key: str | None, arm_index: int, arm: dict[str, Any],
                     result: BenchResult, on_result: Callable[[BenchRow], Any] | None) -> None:
    async with _client(url, key, spec.request_timeout) as client:
        try:
            model = await _model_id(client)
        except httpx.HTTPError as exc:
            raise BenchError(f"no server at {url} ({type(exc).__name__}: {exc})") from None
        view = await _server_view(client)
        if not arm:  # no arms: label the server as it runs
            parallel = (view.get("config") or {}).get("parallel") or 1
            arm = {"parallel": parallel}
        result.arms.append({"arm": arm, "setting": setting_label(arm), "model": model, "server": view})
        if spec.warmup:
            await _one_request(client, model, build_prompt(0, 20, "warmup"), 8, time.monotonic())
        for concurrency in spec.concurrency:
            row = BenchRow(arm_index, setting_label(arm), concurrency)
            result.rows.append(row)
            for round_index in range(spec.rounds):
                salt = f"a{arm_index}c{concurrency}r{round_index}-"
                row.rounds.append(await _run_round(client, model, spec, concurrency, salt))
                _compare(result, row)
                await call_back(on_result, row)
            if row.errors == concurrency * spec.rounds:
                first = next(r.error for rnd in row.rounds for r in rnd.requests if r.error)
                raise BenchError(f"every request failed at concurrency {concurrency}: {first}")


def _compare(result: BenchResult, row: BenchRow) -> None:
    if row.arm == 0:
        return
    base = next((r for r in result.rows if r.arm == 0 and r.concurrency == row.concurrency), None)
    if base and base.totals and row.totals and base.total_tok_s > 0:
        row.versus_first = bootstrap_ratio_ci(row.totals, base.totals)


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
        from strata_desk.bench_arms import run_arms

        await run_arms(spec, result, server, on_status,
                       lambda i, arm, url, key: _run_table(spec, url, key, i, arm, result, on_result))
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


# -- the table -------------------------------------------------------------------------------


def _secs(x: float) -> str:
    return "-" if x != x else f"{x:.1f} s"


def format_table(result: BenchResult) -> str:
    """The seed's table, rows by concurrency then arm, and the arms' comparisons below it."""
    first = result.arms[0]["setting"] if result.arms else "first"
    versus = "vs one at a time" if first == "one at a time" else f"vs {first}"
    lines = [f"| Concurrent | Setting | Total tok/s | {versus} | Per request tok/s "
             "| First token: median / last of the round |",
             "|---|---|---|---|---|---|"]
    rows = sorted(result.rows, key=lambda r: (r.concurrency, r.arm))
    for row in rows:
        vs = "-" if row.versus_first is None else f"{(row.versus_first.ratio - 1) * 100:+.0f} %"
        err = f" ({row.errors} failed)" if row.errors else ""
        lines.append(f"| {row.concurrency} | {row.setting} | {row.total_tok_s:.1f}{err} | {vs} | "
                     f"{row.per_request_tok_s:.1f} | {_secs(row.ttft_median_s)} / {_secs(row.ttft_last_s)} |")
    comparisons = [r for r in rows if r.versus_first is not None]
    if comparisons:
        lines.append("")
        lines.append(f"Total tok/s against {first}: ratio of medians, 95% bootstrap interval")
        for row in comparisons:
            lines.append(f"  {row.concurrency} concurrent, {row.setting}: {row.versus_first.percent}")
    return "\n".join(lines)


# -- command line ----------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", help="server base URL (default: the config's host and port)")
    parser.add_argument("--concurrency", default="1,2,4,8", help="requests sent at once, e.g. 1,2,4,8")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens per answer (default 256)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per concurrency; medians (default 3)")
    parser.add_argument("--prompt-words", type=int, default=800, help="words per prompt (default 800)")
    parser.add_argument("--key", help="API key (default: the config's api_key)")
    parser.add_argument("--arms", nargs="+", metavar="K=V[,K=V]",
                        help='config settings to compare, e.g. "parallel=1" "parallel=2" (needs --config)')
    parser.add_argument("--config", type=Path, help="the server's config (needed for --arms)")
    parser.add_argument("--out", type=Path, help="save the results as JSON here")
    parser.add_argument("--no-warmup", action="store_true", help="skip the uncounted warm-up request")
    parser.add_argument("--thinking", action="store_true",
                        help="let thinking models think (default: chat_template_kwargs.enable_thinking=false)")


def spec_from_args(args: argparse.Namespace) -> BenchSpec:
    for name in ("max_tokens", "rounds"):
        if getattr(args, name) < 1:
            raise BenchError(f"--{name.replace('_', '-')} must be 1 or more")
    if args.prompt_words < 0:
        raise BenchError("--prompt-words must be 0 or more")
    arms = [parse_arm(a) for a in args.arms or []]
    if arms and args.config is None:
        raise BenchError("--arms needs --config FILE (bench rewrites it and restarts the server)")
    return BenchSpec(url=args.url, concurrency=parse_concurrency(args.concurrency), max_tokens=args.max_tokens,
                     rounds=args.rounds, prompt_words=args.prompt_words, key=args.key, arms=arms,
                     config=args.config, out=args.out, warmup=not args.no_warmup, thinking=args.thinking)


def main(args: argparse.Namespace) -> int:
    """Run `strata-desk bench` from parsed arguments; BenchError / ConfigError go to the caller."""
    spec = spec_from_args(args)

    def progress(row: BenchRow) -> None:
        last = row.rounds[-1]
        print(f"  {row.setting}, {row.concurrency} concurrent, round {len(row.rounds)}: "
              f"{last.total_tok_s:.1f} tok/s", flush=True)

    last_kind = [""]

    def status(text: str) -> None:  # one line per phase, not one per /health poll
        kind = text.split(" ", 1)[0].rstrip(",")
        if kind in ("starting", "loading") and kind == last_kind[0]:
            return
        last_kind[0] = kind
        print(f"  {text}", flush=True)

    result = asyncio.run(run_bench(spec, progress, on_status=status))
    print()
    print(format_table(result))
    if spec.out:
        print(f"\nresults saved to {spec.out}")
    return 0


__all__ = ["BenchError", "BenchResult", "BenchRow", "BenchSpec", "RoundResult", "RequestResult",
           "build_prompt", "format_table", "parse_arm", "run_bench"]
