"""What the dashboard shows, derived from a /metrics snapshot (pure functions, unit-tested).

Keeping these rules out of the widgets means the widgets only lay things out, and the rules
("is this model dense?", "which options does the engine support?") live in one place.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from server.metrics_schema import EngineView, LiveView, MetricsSnapshot, TierView

DashState = Literal["loading", "ready", "busy", "error", "stopped"]

# Options the engine may not run yet; a running engine lists the ones it accepts but does not run
# in its INFO key `unsupported` (docs/protocol.md). They change what a window does.
OPTIONAL_OPTIONS = ("batch_mtp", "batch_groups")
ADAPT_OPTIONS = ("adapt_swaps", "adapt_decay", "adapt_min_gain", "adapt_min_count", "adapt_async")  # what a round does
GPU_TIER_OPTIONS = ("pcie_frac", "prefill_borrow", "mmap_experts")  # what only the GPU tier runs
TIER_OPTIONS = ("adapt_every", *ADAPT_OPTIONS, *GPU_TIER_OPTIONS)  # what tunes an expert cache


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


NO_EFFECT = "kept in the config; no effect: "


FIXED_CACHE_WINDOWS = 1_000_000  # upstream's way to write a cache that never adapts (`--adapt-every 1000000`)


def option_notes(data: Mapping[str, object], engine: EngineView | None) -> dict[str, str]:
    """Why options of the settings form would have no effect as the form now stands (`data`, the
    values being edited) on this model and machine (`engine`, None before one has started): the tier
    options without an expert cache or on a dense model, pcie_frac, prefill_borrow and mmap_experts on the simulated tier (no GPU),
    a round's options while adapt_every is 0, one parking limit while the other is 0, the CPU's
    activations when nothing runs on the CPU (a GPU with every expert in VRAM), CUDA graphs on the CPU
    or with a layer split, CPU plans on a GPU or with an expert tier, dense copies on the CPU or in exact mode; and what the expert cache and a layer split are on a machine without a GPU."""
    notes: dict[str, str] = {}
    info = engine.info if engine is not None else {}
    device = str(info.get("device", data.get("device", "")))
    on_cpu = device == "cpu"
    if info.get("experts") == 0:
        notes.update({option: NO_EFFECT + "a dense model has no routed experts"
                      for option in ("expert_cache", *TIER_OPTIONS)})
    elif data.get("expert_cache") is None:
        notes.update({option: NO_EFFECT + "no expert cache (expert-cache empty: every expert stays in memory)"
                      for option in TIER_OPTIONS})
    else:
        if on_cpu:
            notes["expert_cache"] = ("the simulated tier (no GPU): slots in host RAM, to watch the tier's figures; "
                                     "it does not make the CPU faster")
            notes["pcie_frac"] = NO_EFFECT + "the simulated tier (no GPU) reads nothing over PCIe, it runs 0"
            notes["prefill_borrow"] = NO_EFFECT + "the simulated tier (no GPU) has no VRAM to lend"
            notes["mmap_experts"] = NO_EFFECT + "the simulated tier (no GPU) keeps its experts in RAM"
        every = data.get("adapt_every")
        if every == 0:
            notes.update({option: NO_EFFECT + "adapt-every is 0: the cache stays as seeded"
                          for option in ADAPT_OPTIONS})
        elif isinstance(every, int) and every >= FIXED_CACHE_WINDOWS:
            notes.update({option: NO_EFFECT + f"adapt-every {every:,}: a fixed cache (no round comes), as 0 is"
                          for option in ADAPT_OPTIONS})
    if on_cpu and data.get("layer_split") not in (None, "", "auto"):
        notes["layer_split"] = "on the CPU the stages take turns on the same cores: no speed-up"
    if on_cpu:
        notes["cuda_graphs"] = NO_EFFECT + "CUDA graphs replay GPU work; the CPU runs every window as it comes"
    elif data.get("layer_split") not in (None, ""):
        notes["cuda_graphs"] = NO_EFFECT + "a layer split runs its stages' windows without graphs"
    if on_cpu:
        notes["dense_copies"] = NO_EFFECT + "dense copies speed up GPU products; the CPU reads the blocks"
    elif data.get("exact"):
        notes["dense_copies"] = NO_EFFECT + "exact mode keeps no copies (torch's products depend on the rows)"
    if device.startswith("cuda"):
        notes["cpu_plans"] = NO_EFFECT + "CPU plans replay CPU decode windows; this engine decodes on the GPU"
    elif on_cpu and data.get("expert_cache") is not None:
        notes["cpu_plans"] = NO_EFFECT + "the expert tier's windows run as they come (it reads its routing on the host)"
    if device.startswith("cuda") and data.get("expert_cache") is None:
        notes["cpu_activations"] = NO_EFFECT + "every product runs on the GPU (no expert cache: no expert on the CPU)"
    for option, other in (("conversation_cache_mib", "conversation_cache_slots"),
                          ("conversation_cache_slots", "conversation_cache_mib")):
        if data.get(other) == 0 and data.get(option) != 0:
            notes[option] = NO_EFFECT + f"parking is off while {other.replace('_', '-')} is 0"
    return notes


def layer_split_note(engine: EngineView | None) -> str | None:
    """What a config's layer split does on this engine: None when it runs it (or has not said)."""
    if "layer_split" in unsupported_options(engine):
        return "not run by this engine yet: one device runs every layer"
    return None


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


@dataclass(frozen=True)
class TierWindow:
    """How the routed experts looked up between two snapshots were served."""

    seconds: float  # between the two engine STATS the snapshots carry
    lookups: int
    vram_share: float  # the cache's hit rate over the window
    pcie_share: float
    cpu_share: float
    swaps: int = 0  # experts the adapt rounds copied into slots in the window
    adapt_rounds: int = 0
    adapt_wait_ms: float | None = None  # what the window's decoding waited for those rounds (None: not sent)


def tier_window(before: TierView, before_at: float, now: TierView, now_at: float) -> TierWindow | None:
    """The window between two tier views from their totals; None when nothing was looked up between
    them, or when the totals went back (the engine restarted) or are not sent (an older server)."""
    if before.hits is None or before.lookups is None or now.hits is None or now.lookups is None:
        return None
    lookups, hits, pcie = now.lookups - before.lookups, now.hits - before.hits, now.offloaded - before.offloaded
    swaps, rounds = now.swaps - before.swaps, now.adapt_rounds - before.adapt_rounds
    if lookups <= 0 or hits < 0 or pcie < 0 or hits + pcie > lookups or swaps < 0 or rounds < 0:
        return None
    wait = (now.adapt_wait_total_ms - before.adapt_wait_total_ms
            if now.adapt_wait_total_ms is not None and before.adapt_wait_total_ms is not None else None)
    if wait is not None and wait < 0:
        return None
    return TierWindow(seconds=max(0.0, now_at - before_at), lookups=lookups, vram_share=hits / lookups,
                      pcie_share=pcie / lookups, cpu_share=(lookups - hits - pcie) / lookups,
                      swaps=swaps, adapt_rounds=rounds, adapt_wait_ms=wait)


@dataclass
class History:
    """Rolling series the widgets draw (one sample per poll, 60 s at 1 Hz)."""

    length: int = 60
    slot_length: int = 20
    total: deque[float] = field(default_factory=lambda: deque(maxlen=60))
    prefill: deque[float] = field(default_factory=lambda: deque(maxlen=60))
    # the expert cache's hit rate per window (since start from a server that sends no totals)
    hit_rate: deque[float] = field(default_factory=lambda: deque(maxlen=60))
    tier_window: TierWindow | None = None  # the last window in which experts were looked up
    slots: dict[int | str, deque[float]] = field(default_factory=dict)
    _tier_base: tuple[TierView, float] | None = None  # the totals the next window starts from, and when

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
        self._push_tier(snapshot)

    def _push_tier(self, snapshot: MetricsSnapshot) -> None:
        tier = snapshot.tier
        if tier is None or tier.mode == "resident":
            return
        if tier.lookups is None:  # an older server: only the rate since start
            if tier.hit_rate is not None:
                self.hit_rate.append(tier.hit_rate)
            return
        at = snapshot.stats.at if snapshot.stats is not None and snapshot.stats.at else snapshot.time
        base = self._tier_base
        if base is not None and tier.lookups == base[0].lookups:
            return  # no new STATS, or nothing decoded: the last window stands
        self._tier_base = (tier, at)
        window = tier_window(base[0], base[1], tier, at) if base is not None else None
        if window is not None:
            self.tier_window = window
            self.hit_rate.append(window.vram_share)

    def clear(self) -> None:
        self.total.clear()
        self.prefill.clear()
        self.hit_rate.clear()
        self.slots.clear()
        self.tier_window = None
        self._tier_base = None


@dataclass
class HeaderInfo:
    """What the top bar shows (tui/widgets/header_bar.py lays it out)."""

    model: str = ""
    state: DashState = "loading"
    url: str = ""
    uptime_s: float | None = None
    version: str | None = None
    mode: str = ""  # "managed", "attached"
    detail: str = ""  # e.g. "starting the engine (12 s)"
    restarts: int = 0  # times the server had to restart a dead engine
    key: bool = False  # clients need an API key
    last_error: str | None = None


BannerText = tuple[str | None, str, str, str]  # level (None: no banner), message, detail, keys


@dataclass(frozen=True)
class DeskState:
    """Everything the header and the banner are drawn from, as plain values (the app gathers it)."""

    phase: str  # tui/lifecycle.py Phase
    mode: str = "managed"  # "managed", "attached", "setup"
    snapshot: MetricsSnapshot | None = None
    poll_error: str | None = None
    base_url: str | None = None
    url: str = ""  # the URL to give clients
    served_name: str = ""  # the config's model name, shown before the engine says it
    progress: str = ""  # the start's progress line
    failure: tuple[str, list[str]] | None = None  # why the server failed, and its log tail
    inflight: int = 0
    can_manage: bool = False
    backup_exists: bool = False  # a .bak config can be restored
    server_lines: tuple[str, ...] = ()  # the server log's last lines
    bench_status: str | None = None  # a benchmark that restarts the server is running


def header_info(desk: DeskState) -> HeaderInfo:
    snap = desk.snapshot
    starting = desk.phase in ("starting", "restarting", "idle")
    state = dash_state(snap, starting=starting, failed=desk.phase == "failed", reachable=desk.poll_error is None)
    if desk.phase == "stopping":
        state = "stopped"
    model = (snap.engine.model if snap else "") or desk.served_name
    detail = ""
    if starting:
        detail = desk.progress
    elif desk.phase == "draining":
        detail = f"draining: {desk.inflight} in flight"
    elif snap is not None and desk.poll_error is None:
        detail = snap.live.phase if snap.live.phase not in ("idle", "") else ""
    return HeaderInfo(
        model=model,
        state=state,
        url=desk.url,
        uptime_s=snap.uptime_s if snap is not None and not starting else None,
        version=snap.engine.version if snap else None,
        mode="attached" if desk.mode == "attached" else "managed",
        detail=detail,
        restarts=snap.engine.restarts if snap else 0,
        key=bool(snap.config.api_key_set) if snap else False,
        last_error=snap.engine.last_error if snap else None,
    )


def banner(desk: DeskState) -> BannerText:
    """The banner under the header: the most pressing thing to say, and the keys that help."""
    if desk.phase == "failed" and desk.failure is not None:
        message, tail = desk.failure
        keys = []
        if desk.backup_exists:
            keys.append("u restore the previous config (.bak) and restart")
        if desk.can_manage:
            keys += ["r try again", "s settings"]
        keys += ["l full log", "q quit"]
        return "error", message, "\n".join(tail[-12:]), "   ".join(keys)
    if desk.phase in ("starting", "restarting"):
        verb = "Restarting" if desk.phase == "restarting" else "Starting"
        return ("info", f"{verb} the server and the engine: {desk.progress}", "\n".join(desk.server_lines[-3:]),
                "")
    if desk.phase == "draining":
        return ("warn", f"Waiting for {desk.inflight} request(s) in flight to finish, then restarting",
                "", "x restart now   esc cancel the restart")
    if desk.phase == "stopping":
        return "info", "Stopping the server and the engine ...", "", ""
    if desk.bench_status:
        return "info", f"Benchmark running: {desk.bench_status}", "", "b shows the bench"
    if desk.poll_error and desk.base_url:
        return "error", f"Cannot read {desk.base_url}/metrics: {desk.poll_error}", "", "q quit"
    snap = desk.snapshot
    if snap is not None and (snap.engine.state == "dead" or snap.live.state == "dead"):
        first, _, rest = (snap.engine.last_error or "").partition("\n")
        detail = rest + (f"\nrestarts so far: {snap.engine.restarts}" if snap.engine.restarts else "")
        keys = "the server starts it again for the next request   " + (
            "r restart now   l full log" if desk.can_manage else "l full log")
        return "error", "The engine stopped" + (f": {first}" if first else ""), detail.strip(), keys
    note = model_note(snap)
    return ("info", note, "", "") if note else (None, "", "", "")
