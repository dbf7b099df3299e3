"""`strata-desk bench` on the command line: its arguments, the spec from them, the printed run."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from strata_desk.bench.results import BenchRow
from strata_desk.bench.run import run_bench
from strata_desk.bench.spec import BenchError, BenchSpec, parse_arm, parse_concurrency
from strata_desk.bench.table import format_table


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
