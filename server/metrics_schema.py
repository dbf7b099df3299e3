"""The shape of GET /metrics (JSON) and GET /v1/status: the dashboard's single feed.

This module is the contract between the server and the dashboard (`tui` imports this module and
nothing else of the server). It is pure pydantic: no I/O, no server state. docs/metrics.md explains
every field. Units: memory in MiB, times in seconds unless the name ends in `_ms`, rates in tokens
per second, shares in [0, 1].

The engine's `STATS <json>` line is parsed with `EngineStats` (all fields optional, unknown fields
kept), so an engine that reports less still gives a valid snapshot.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

SlotState = Literal["idle", "reading", "decoding"]
LiveState = Literal["loading", "idle", "reading", "generating", "dead"]
Finish = Literal["stop", "length", "cancel", "disconnect", "error"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ---------------------------------------------------------------------------------------------
# What the engine sends on its STATS line (engine -> server, JSON after the word STATS)


class HotExpert(BaseModel):
    """One of the tier's hottest experts (STATS `tier.hot`): its share of its layer's recent routing
    (the decayed counts the adapt rounds rank by) and whether a cache slot holds it."""

    model_config = ConfigDict(extra="ignore")
    layer: int
    expert: int
    share: float
    cached: bool


class StatsTier(BaseModel):
    """Expert-tier figures (docs/protocol.md, STATS). vram/pcie/cpu may be shares or counts of the
    routed experts served each way; the server normalizes them to shares."""

    model_config = ConfigDict(extra="allow")
    mode: str | None = None  # "resident" (every expert in device memory) or "simulated" (the CPU's cache tier)
    vram: float = 0.0  # served from the VRAM expert cache
    pcie: float = 0.0  # read over PCIe and computed on the GPU
    cpu: float = 0.0  # computed on the CPU
    hits: int | None = None  # decode VRAM-tier hits (as DONE's hits)
    lookups: int | None = None
    swaps: int = 0  # experts moved by the adaptive tier (total)
    adapt_rounds: int = 0
    adapt_wait_ms: float = 0.0  # main-thread time waiting for the tier, mean per window since start
    adapt_wait_total_ms: float | None = None  # the same, in all (total)
    hot: list[HotExpert] = Field(default_factory=list)  # the hottest experts, hottest first
    experts_cached: int | None = None  # experts held in the VRAM cache now
    experts_total: int | None = None  # routed experts in the model
    slots: int | None = None  # cache slots (all layers)
    device_slots: dict[str, int] = Field(default_factory=dict)  # the GPU tier's slots per device ("cuda:0")
    cache_mib: float | None = None  # the slots' bytes
    offloaded: int = 0  # decode entries served over PCIe (DONE's offloaded, summed)
    cpu_ms: float = 0.0  # time spent computing the CPU's entries (total)


class StatsDevice(BaseModel):
    """One device's memory split as the engine sees it (MiB). `device` is "cuda:N" or "cpu"."""

    model_config = ConfigDict(extra="allow")
    device: str = "cuda:0"
    total_mib: float | None = None
    weights_mib: float = 0.0  # every weight
    experts_mib: float = 0.0  # the routed experts among them (the expert cache)
    slots_mib: float = 0.0  # batch-slot sessions
    kv_mib: float = 0.0  # the solo session's KV
    free_mib: float | None = None

    @property
    def cuda_index(self) -> int | None:
        kind, _, idx = self.device.partition(":")
        if kind != "cuda":
            return None
        return int(idx) if idx.isdigit() else 0


class StatsParking(BaseModel):
    """Parked conversations (docs/protocol.md, STATS `parking`): counts since start, `parked`/`bytes` now."""

    model_config = ConfigDict(extra="allow")
    parked: int = 0
    bytes: int = 0  # host memory of the parked conversations
    parks: int = 0
    evictions: int = 0
    skipped: int = 0
    lookups: int = 0  # reads that started while anything was parked
    restores: int = 0  # reads that continued a parked conversation
    restore_ms: float = 0.0  # the last restore
    restore_ms_mean: float = 0.0


class EngineStats(BaseModel):
    """`STATS {json}` (docs/protocol.md): windows, tokens and tier counts are totals since start;
    rows and window_ms are means over the windows since the previous STATS line."""

    model_config = ConfigDict(extra="allow")
    windows: int = 0
    rows: float = 0.0  # mean rows per window (recent)
    window_ms: float | None = None  # mean ms per window (recent)
    tokens: int = 0  # rows decoded in windows (total)
    slot_tokens: dict[str, int] = Field(default_factory=dict)
    prefill_tokens: int = 0
    prefill_ms: float = 0.0
    tier: StatsTier | None = None  # None for a dense model
    memory: list[StatsDevice] = Field(default_factory=list)
    parking: StatsParking | None = None  # None when parking is off


# ---------------------------------------------------------------------------------------------
# /metrics


class EngineView(_Model):
    """The engine process and every INFO key it reported (`info`, values as the engine sent them)."""

    state: Literal["starting", "ready", "dead", "stopped"] = "starting"
    model: str = ""  # served model name
    model_path: str = ""
    max_context: int | None = None  # from READY
    version: str | None = None  # INFO engine=
    pid: int | None = None
    restarts: int = 0
    started_at: float | None = None  # unix time the current engine process started
    ready_s: float | None = None  # seconds from spawn to READY
    last_error: str | None = None
    log_path: str | None = None
    info: dict[str, int | float | str] = Field(default_factory=dict)


class SlotView(_Model):
    """One batch slot. Never carries prompt text."""

    slot: int
    state: SlotState = "idle"
    prompt_tokens: int = 0
    generated: int = 0
    elapsed_s: float = 0.0
    tok_s: float = 0.0
    held_tokens: int = 0  # tokens of the conversation the slot keeps (prompt + answer)


class LiveView(_Model):
    state: LiveState = "loading"
    phase: str = ""  # "loading", "idle", "reading the prompt", "answering", "waiting for a slot"
    queued: int = 0  # requests waiting (solo FIFO or for a slot)
    running: int = 0  # requests in flight on the engine
    tok_s: float = 0.0  # generated tokens/s over the last tok_s_window_s, summed over requests
    tok_s_window_s: float = 10.0
    tok_s_mean: float = 0.0  # mean decode rate per request: recent finished ones and those running
    prefill_tok_s: float = 0.0  # last PP line's rate
    prefill_tok_s_mean: float = 0.0
    prompt_read: int = 0  # of the prompt being read now (PP)
    prompt_total: int = 0
    generated: int = 0  # of the request on the solo path (0 when none)
    max_tokens: int = 0
    elapsed_s: float = 0.0  # since it went onto the solo path (its queue time not counted)
    # with batch slots (parallel >= 2); parallel is 1 and slots [] without
    parallel: int = 1
    waiting_for_slot: int = 0
    slots: list[SlotView] = Field(default_factory=list)


class RequestRow(_Model):
    """A finished request, newest first in MetricsSnapshot.requests."""

    id: str
    time: float  # unix time the request arrived
    endpoint: str = "chat"  # chat | completions
    duration_s: float = 0.0
    ttft_s: float | None = None  # first token latency
    finish: Finish = "stop"
    prompt_tokens: int = 0
    reused: int = 0  # prompt tokens the engine reused (cache)
    output_tokens: int = 0
    prompt_read: int = 0
    prompt_ms: float = 0.0
    decode_ms: float = 0.0
    decode_tok_s: float = 0.0
    prefill_tok_s: float = 0.0
    hit_rate: float | None = None  # VRAM-tier hits / lookups
    path: str = "solo"  # solo | slot | solo+slot
    slot: int | None = None  # last slot used
    yields: int = 0
    returns_to_solo: int = 0
    error: str | None = None


class Totals(_Model):
    since: float = 0.0
    requests: int = 0
    errors: int = 0
    disconnects: int = 0
    prompt_tokens: int = 0
    reused: int = 0
    output_tokens: int = 0
    prompt_ms: float = 0.0
    decode_ms: float = 0.0
    hits: int = 0  # routed-expert lookups served from VRAM during decode (DONE's hits)
    lookups: int = 0
    requests_kept: int = 0


class MemorySplit(_Model):
    """A GPU's memory by use, from the engine's STATS (MiB)."""

    weights_mib: float = 0.0
    experts_mib: float = 0.0
    slots_mib: float = 0.0
    kv_mib: float = 0.0
    free_mib: float | None = None
    other_mib: float | None = None  # used by NVML's count but by nothing above (CUDA context, others)
    layers: str | None = None  # the layer range this card runs on a layer split ("0-23"), from INFO layer_split
    expert_slots: int | None = None  # the GPU expert tier's cache slots on this card (experts_mib is their bytes)


class GpuInfo(_Model):
    index: int
    name: str
    total_mib: float
    used_mib: float
    free_mib: float
    util_pct: float | None = None
    temp_c: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    pcie_to_mib_s: float | None = None  # PCIe traffic to the GPU (host -> GPU), MiB/s, NVML's 20 ms sample
    pcie_from_mib_s: float | None = None  # and from it; both None where NVML has no counters
    split: MemorySplit | None = None  # filled from STATS when the engine reported this device


class HostInfo(_Model):
    cpu_pct: float = 0.0
    cpu_count: int = 0
    ram_total_mib: float = 0.0
    ram_used_mib: float = 0.0
    ram_available_mib: float = 0.0
    engine_rss_mib: float | None = None


class TierView(_Model):
    """Expert-tier figures; `tier` is null when unknown or for a dense model."""

    vram_share: float = 0.0
    pcie_share: float = 0.0
    cpu_share: float = 0.0
    hit_rate: float | None = None
    swaps: int = 0  # total, as adapt_rounds
    adapt_rounds: int = 0
    adapt_wait_ms: float = 0.0  # mean per decode window since start
    adapt_wait_total_ms: float | None = None  # total: two snapshots give the wait between them
    hot: list[HotExpert] = Field(default_factory=list)  # the hottest experts now, hottest first
    experts_cached: int | None = None
    experts_total: int | None = None
    mode: str | None = None  # "resident": every expert in the model's memory, no cache; "simulated": the CPU's tier
    slots: int | None = None  # cache slots over all layers
    cache_mib: float | None = None  # the slots' bytes
    cpu_ms: float = 0.0  # CPU expert time (total)
    hits: int | None = None  # decode lookups served from VRAM (total; STATS hits)
    lookups: int | None = None  # decode lookups (total): two snapshots give the figures between them
    offloaded: int = 0  # decode lookups served over PCIe (total)


class ParkingView(_Model):
    """Conversations parked in host memory when their slot was taken; null when parking is off."""

    parked: int = 0  # conversations parked now
    parked_mib: float = 0.0
    limit_mib: int | None = None  # INFO conversation_cache_mib
    limit_slots: int | None = None  # INFO conversation_cache_slots
    parks: int = 0
    evictions: int = 0
    restores: int = 0
    restore_ms_last: float = 0.0
    restore_ms_mean: float = 0.0
    hit_rate: float | None = None  # restores / reads that started while anything was parked


class StatsView(_Model):
    """The engine's last STATS line, as the dashboard shows it."""

    windows: int = 0  # decode windows since the engine started
    rows: int = 0  # rows (tokens) decoded in windows since the engine started
    ms_per_window: float | None = None  # recent mean
    rows_per_window: float | None = None  # recent mean
    prefill_tokens: int = 0
    prefill_ms: float = 0.0
    slot_tokens: dict[str, int] = Field(default_factory=dict)  # tokens decoded per slot (total)
    at: float | None = None  # unix time of the last STATS line


class ConfigView(_Model):
    """The options in force (the run config minus the api key)."""

    model_config = ConfigDict(extra="allow")
    path: str | None = None
    model: str = ""
    host: str = "127.0.0.1"
    port: int = 0
    parallel: int = 1
    batch_groups: int | str = "auto"
    batch_mtp: bool = False
    adapt_every: int = 0
    adapt_swaps: int = 0
    adapt_decay: float = 0.0
    adapt_async: bool = False
    adapt_min_gain: float = 0.0
    pcie_frac: float = 0.0
    conversation_cache_mib: int = 0
    conversation_cache_slots: int = 0
    context: int = 0
    queue_limit: int = 0
    api_key_set: bool = False


class MetricsSnapshot(_Model):
    """GET /metrics."""

    time: float
    uptime_s: float
    engine: EngineView
    live: LiveView
    requests: list[RequestRow] = Field(default_factory=list)
    totals: Totals = Field(default_factory=Totals)
    devices: list[GpuInfo] = Field(default_factory=list)
    host: HostInfo = Field(default_factory=HostInfo)
    config: ConfigView = Field(default_factory=ConfigView)
    tier: TierView | None = None
    stats: StatsView | None = None
    parking: ParkingView | None = None


# ---------------------------------------------------------------------------------------------
# /v1/status


class Concurrency(_Model):
    serving: int = 1  # batch slots the engine runs (INFO batch_slots), 1 without
    requested: int = 1  # config.parallel


class Timings(_Model):
    """llama.cpp-style timings (also the `timings` of a completion)."""

    cache_n: int = 0
    prompt_n: int = 0
    prompt_ms: float = 0.0
    prompt_per_token_ms: float = 0.0
    prompt_per_second: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    predicted_per_token_ms: float = 0.0
    predicted_per_second: float = 0.0


class Activity(_Model):
    requests: int = 0
    in_flight: int = 0
    queued: int = 0
    last_request_at: float | None = None


class StatusView(_Model):
    """GET /v1/status."""

    service: str = "strata-desk"
    model: str
    loaded: bool
    engine: str | None = None
    started: float
    uptime_s: float
    context: dict[str, Any] = Field(default_factory=dict)
    concurrency: Concurrency = Field(default_factory=Concurrency)
    activity: Activity = Field(default_factory=Activity)
    last_timings: Timings | None = None
