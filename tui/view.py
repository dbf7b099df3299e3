"""What the dashboard shows, derived from a /metrics snapshot (pure functions, unit-tested).

Keeping these rules out of the widgets means the widgets only lay things out, and the rules
("is this model dense?", "which options does the engine support?") live in one place.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from server.metrics_schema import EngineView, LiveView, MetricsSnapshot

DashState = Literal["loading", "ready", "busy", "error", "stopped"]

# Options the engine may not run yet; a running engine lists the ones it accepts but does not run
# in its INFO key `unsupported` (docs/protocol.md). The first three change what a window does; the
# tier options only tune an expert tier that is not the whole model.
OPTIONAL_OPTIONS = ("batch_mtp", "adapt_async", "batch_groups")
TIER_OPTIONS = ("adapt_every", "adapt_swaps", "adapt_decay", "adapt_min_gain", "pcie_frac")


def unsupported_options(engine: EngineView | None) -> set[str]:
    """What the engine says it does not run (empty before it has started)."""
    if engine is None:
        return set()
    return {p.strip() for p in str(engine.info.get("unsupported", "")).split(",") if p.strip()}


def supported_options(engine: EngineView | None) -> set[str]:
    """The optional options this engine runs: none until an engine has said otherwise."""
    if engine is None or "unsupported" not in engine.info:
        return set()
    return set(OPTIONAL_OPTIONS) - unsupported_options(engine)


def is_dense(snapshot: MetricsSnapshot) -> bool:
    """True when the model has no routed experts (the tier panels say "dense model")."""
    experts = snapshot.engine.info.get("experts")
    return experts is not None and int(experts) == 0


GENERATED_NOTE = ("A generated test model: its weights are random, so its text is meaningless; it is here to show "
                  "the MoE machinery (slots, experts)")


def model_note(snapshot: MetricsSnapshot | None) -> str | None:
    """What the banner says about the model when nothing else needs saying: a generated model's
    text is meaningless (the engine's INFO `generated=1`)."""
    if snapshot is not None and snapshot.engine.info.get("generated") == 1:
        return GENERATED_NOTE
    return None


def has_tier_data(snapshot: MetricsSnapshot) -> bool:
    tier = snapshot.tier
    if tier is None:
        return False
    return (tier.vram_share + tier.pcie_share + tier.cpu_share) > 0 or tier.hit_rate is not None


def dash_state(snapshot: MetricsSnapshot | None, *, starting: bool, failed: bool, reachable: bool) -> DashState:
    if failed:
        return "error"
    if starting:
        return "loading"
    if snapshot is None:
        return "error" if not reachable else "loading"
    if not reachable:
        return "error"
    if snapshot.engine.state == "dead" or snapshot.live.state == "dead":
        return "error"
    if snapshot.engine.state == "stopped":
        return "stopped"
    if snapshot.engine.state == "starting" or snapshot.live.state == "loading":
        return "loading"
    live: LiveView = snapshot.live
    if live.state in ("reading", "generating") or live.running > 0 or live.queued > 0:
        return "busy"
    return "ready"


def solo_active(live: LiveView) -> bool:
    """A request runs on the solo path (not in a slot): always so with parallel 1."""
    if live.state not in ("reading", "generating"):
        return False
    if live.parallel <= 1 or not live.slots:
        return True
    busy_slots = sum(1 for s in live.slots if s.state != "idle")
    return live.running > busy_slots


def solo_tok_s(live: LiveView) -> float:
    """The solo request's rate: the total less what the slots decode."""
    if not solo_active(live) or live.state != "generating":
        return 0.0
    return max(0.0, live.tok_s - sum(s.tok_s for s in live.slots if s.state == "decoding"))


@dataclass
class History:
    """Rolling series the widgets draw (one sample per poll, 60 s at 1 Hz)."""

    length: int = 60
    slot_length: int = 20
    total: deque[float] = field(default_factory=lambda: deque(maxlen=60))
    prefill: deque[float] = field(default_factory=lambda: deque(maxlen=60))
    slots: dict[int | str, deque[float]] = field(default_factory=dict)

    def slot(self, key: int | str) -> deque[float]:
        if key not in self.slots:
            self.slots[key] = deque(maxlen=self.slot_length)
        return self.slots[key]

    def push(self, snapshot: MetricsSnapshot) -> None:
        live = snapshot.live
        self.total.append(live.tok_s)
        reading = live.state == "reading" or any(s.state == "reading" for s in live.slots)
        self.prefill.append(live.prefill_tok_s if reading else 0.0)
        for s in live.slots:
            self.slot(s.slot).append(s.tok_s if s.state == "decoding" else 0.0)
        self.slot("solo").append(solo_tok_s(live))

    def clear(self) -> None:
        self.total.clear()
        self.prefill.clear()
        self.slots.clear()
