"""The seed's table of a benchmark's rows, and the arms' comparisons below it."""

from __future__ import annotations

from strata_desk.bench.results import BenchResult


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
                     f"{row.per_request_tok_s:.1f} | {row.first_token_text} |")
    comparisons = [r for r in rows if r.versus_first is not None]
    if comparisons:
        lines.append("")
        lines.append(f"Total tok/s against {first}: ratio of medians, 95% bootstrap interval")
        for row in comparisons:
            lines.append(f"  {row.concurrency} concurrent, {row.setting}: {row.versus_first.percent}")
    together = [r for r in rows if r.versus_alone is not None]
    if together:
        lines.append("")
        lines.append("Total tok/s against the same setting one request at a time (concurrency 1): ratio of medians, "
                     "95% bootstrap interval")
        for row in together:
            lines.append(f"  {row.concurrency} concurrent, {row.setting}: {row.versus_alone.times}")
    return "\n".join(lines)
