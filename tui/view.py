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

# Options a stock engine may not run yet: shown as "not supported by this engine yet" unless the
# engine says otherwise in its INFO keys (see `supported_options`).
OPTIONAL_OPTIONS = ("batch_mtp", "adapt_async", "batch_groups")

_TRUE = {"1", "true", "yes", "on"}


def _truthy(value: object) -> bool:
    return str(value).strip().lower() in _TRUE


def supported_options(engine: EngineView | None) -> set[str]:
    """The optional options this engine runs, from its INFO keys.

    Recognised forms (any of them): `supports=batch_mtp,adapt_async` (also `options=`,
    `features=`), or one key per option: `batch_mtp=1`, `supports_batch_mtp=1`, `adapt_async=1`,
    and `batch_groups` / `max_batch_groups` above 1 for pipelined groups.
    """
    found: set[str] = set()
    if engine is None:
        return found
    info = {str(k).lower().replace("-", "_"): v for k, v in engine.info.items()}
    for key in ("supports", "options", "features", "supported_options"):
        if key in info:
            found.update(p.strip().replace("-", "_") for p in str(info[key]).split(",") if p.strip())
    for name in OPTIONAL_OPTIONS:
        # a plain `batch_groups=` key is the group count the engine runs, not a capability flag
        plain = () if name == "batch_groups" else (name,)
        for key in (*plain, f"supports_{name}", f"{name}_supported"):
            if key in info and _truthy(info[key]):
                found.add(name)
    for key in ("batch_groups", "max_batch_groups"):
        try:
            if key in info and int(float(info[key])) > 1:
                found.add("batch_groups")
        except ValueError:
            pass
    return found & set(OPTIONAL_OPTIONS)


def is_dense(snapshot: MetricsSnapshot) -> bool:
    """True when the model has no routed experts (the tier panels say "dense model")."""
    info = {str(k).lower(): v for k, v in snapshot.engine.info.items()}
    for key in ("expert_count", "experts", "n_experts", "routed_experts"):
        if key in info:
            try:
                return int(float(info[key])) == 0
            except ValueError:
                pass
    for key in ("moe", "is_moe"):
        if key in info:
            return not _truthy(info[key])
    if "dense" in info:
        return _truthy(info["dense"])
    if snapshot.tier is not None:
        return snapshot.tier.experts_total == 0
    # The engine's STATS carry `tier: null` for a dense model: once STATS arrived without a tier,
    # the model is dense; before the first STATS we do not know yet.
    return snapshot.stats is not None and snapshot.stats.at is not None


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
