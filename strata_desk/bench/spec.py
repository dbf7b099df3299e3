"""What a benchmark runs: `BenchSpec`, the arms' and concurrency's parsing, `BenchError`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class BenchError(RuntimeError):
    """The benchmark cannot run (no server, bad arm, every request failed)."""


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
