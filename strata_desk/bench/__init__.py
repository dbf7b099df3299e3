"""`strata-desk bench`: C different requests at once against a running server, the seed's table,
and A/B arms (rewrite the config, restart the server, run the table again, compare with the first).

Each request is a distinct essay prompt built from a word list, decoded greedily and streamed so the
first token's time is measured. For every (arm, concurrency) the rounds are summarised by medians:

- Total tok/s: the round's generated tokens / the time from sending to the last reply's end;
- Per request tok/s: each request's decode rate (tokens after the first / time after the first
  token), averaged over the round's requests;
- First token: the median request's and the last request's time to first token.

Arms are compared with the first arm by the ratio of the medians of the rounds' total tok/s and a
95% percentile-bootstrap interval (`stats.py`). The dashboard's bench screen calls
`run_bench(spec, on_result)`.

Modules: `spec` (what to run), `prompts`, `client` (requests to the server), `results`, `arms` (the
arms' servers, as an iterator), `run` (`run_bench`), `stats`, `table`, `command` (the CLI).
"""

from strata_desk.bench.prompts import build_prompt
from strata_desk.bench.results import BenchResult, BenchRow, RequestResult, RoundResult
from strata_desk.bench.run import run_bench
from strata_desk.bench.spec import BenchError, BenchSpec, parse_arm, parse_concurrency, setting_label
from strata_desk.bench.table import format_table

__all__ = ["BenchError", "BenchResult", "BenchRow", "BenchSpec", "RequestResult", "RoundResult", "build_prompt",
           "format_table", "parse_arm", "parse_concurrency", "run_bench", "setting_label"]
