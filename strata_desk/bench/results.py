"""A benchmark's results: per request, per round, per (arm, concurrency) row, and the whole run."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from strata_desk.bench.stats import RatioCI, median


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


def _seconds_text(x: float) -> str:
    """Milliseconds below a second (a first token on a GPU: tens of them), else seconds; "-" for none (NaN)."""
    if x != x:
        return "-"
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.1f} s"


@dataclass
class BenchRow:
    arm: int
    setting: str
    concurrency: int
    rounds: list[RoundResult] = field(default_factory=list)
    versus_first: RatioCI | None = None  # this arm against arm 0 at the same concurrency
    versus_alone: RatioCI | None = None  # against this arm's requests one at a time (its concurrency 1)

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

    @property
    def first_token_text(self) -> str:
        """The median and last first token of the rounds (medians), as the tables show them: "23 ms / 25 ms"."""
        return f"{_seconds_text(self.ttft_median_s)} / {_seconds_text(self.ttft_last_s)}"

    def to_dict(self) -> dict[str, Any]:
        out = {"arm": self.arm, "setting": self.setting, "concurrency": self.concurrency,
               "total_tok_s": self.total_tok_s, "per_request_tok_s": self.per_request_tok_s,
               "ttft_median_s": self.ttft_median_s, "ttft_last_s": self.ttft_last_s,
               "errors": self.errors, "rounds": [r.to_dict() for r in self.rounds]}
        for name in ("versus_first", "versus_alone"):
            if getattr(self, name) is not None:
                out[name] = asdict(getattr(self, name))
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
