"""The HTTP server process: OpenAI API, scheduling over the engine's slots, /health, /v1/status, /metrics.

`server.main(argv)` runs it (as `python -m server` and `strata-desk serve` do). Importing this package
is cheap: `server.metrics_schema` (the dashboard's contract) pulls in nothing but pydantic.
"""


def main(argv: list[str] | None = None) -> int:
    from server.cli import main as _main

    return _main(argv)
