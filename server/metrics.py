"""Counting what happens (rates, request rows, totals, the engine's STATS) and rendering the snapshot:
JSON for GET /metrics (server/metrics_schema.py) and Prometheus text for GET /metrics/prometheus."""

from __future__ import annotations

import collections
import time
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from server import hardware
from server.metrics_schema import (
    ConfigView,
    EngineStats,
    EngineView,
    GpuInfo,
    LiveView,
    MemorySplit,
    MetricsSnapshot,
    ParkingView,
    RequestRow,
    SlotView,
    StatsParking,
    StatsView,
    TierView,
    Totals,
)

if TYPE_CHECKING:
    from server.config import RunConfig
    from server.engine_client import EngineSupervisor
    from server.scheduler import Job, Scheduler

RATE_WINDOW_S = 10.0  # tokens arrive in bursts (decode windows, prompt chunks between): a short window jumps
ROWS_KEPT = 500


def stage_layers(layer_split: object) -> dict[int, str]:
    """CUDA index -> the layers its stage runs, from INFO `layer_split` ("0-23@cuda:0,24-47@cuda:1"; "-" or
    missing without a split)."""
    out: dict[int, str] = {}
    for stage in str(layer_split or "-").split(","):
        layers, _, device = stage.partition("@")
        kind, _, index = device.partition(":")
        if kind == "cuda" and index.isdigit():
            out[int(index)] = layers
    return out


class Metrics:
    def __init__(self, config: RunConfig, config_path: str | None):
        self.config = config
        self.config_path = config_path
        self.started = time.time()
        self._buckets: collections.deque[list[float]] = collections.deque()  # [t, tokens] per 0.1 s
        self.rows: collections.deque[RequestRow] = collections.deque(maxlen=ROWS_KEPT)
        self.totals = Totals(since=self.started)
        self.stats: EngineStats | None = None
        self.stats_at: float | None = None
        self.last_job: Job | None = None
        self.output_tokens_live = 0  # counter of every token streamed (Prometheus)
        self._decode_rates: collections.deque[float] = collections.deque(maxlen=50)
        self._prefill_rates: collections.deque[float] = collections.deque(maxlen=50)

    # -- feeding ------------------------------------------------------------------------------
    def on_tokens(self, n: int) -> None:
        self.output_tokens_live += n
        now = time.monotonic()
        b = self._buckets
        if b and now - b[-1][0] < 0.1:
            b[-1][1] += n
        else:
            b.append([now, n])
            while b and now - b[0][0] > RATE_WINDOW_S + 0.2:
                b.popleft()

    def on_stats(self, data: dict[str, Any]) -> None:
        try:
            self.stats = EngineStats.model_validate(data)
            self.stats_at = time.time()
        except Exception:  # a malformed STATS must not break the server
            pass

    def on_finish(self, job: Job) -> None:
        now = time.monotonic()
        n = len(job.generated)
        decode_s = job.decode_ms / 1000
        rate = n / decode_s if decode_s > 0 and n > 1 else 0.0
        read = max(0, (job.prompt_total or len(job.prompt)) - job.reused)
        prefill = read / (job.prompt_ms / 1000) if job.prompt_ms > 0 else 0.0
        if rate:
            self._decode_rates.append(rate)
        if prefill:
            self._prefill_rates.append(prefill)
        finish = job.finish if job.finish in ("stop", "length", "cancel", "disconnect", "error") else "stop"
        paths = list(dict.fromkeys(job.paths))
        row = RequestRow(
            id=job.id, time=job.wall, endpoint=job.endpoint, duration_s=round(now - job.created, 4),
            ttft_s=round(job.first_token_at - job.created, 4) if job.first_token_at else None,
            finish=finish, prompt_tokens=len(job.prompt), reused=job.reused, output_tokens=n,
            prompt_read=job.prompt_read, prompt_ms=round(job.prompt_ms, 3), decode_ms=round(job.decode_ms, 3),
            decode_tok_s=round(rate, 2), prefill_tok_s=round(prefill, 2),
            hit_rate=round(job.hits / job.lookups, 4) if job.lookups else None,
            path="+".join(paths) or "none", slot=job.slot, yields=job.yields,
            returns_to_solo=job.returns_to_solo, error=job.error)
        self.rows.appendleft(row)
        t = self.totals
        t.requests += 1
        t.errors += finish == "error"
        t.disconnects += finish == "disconnect"
        t.prompt_tokens += len(job.prompt)
        t.reused += job.reused
        t.output_tokens += n
        t.prompt_ms += job.prompt_ms
        t.decode_ms += job.decode_ms
        t.hits += job.hits
        t.lookups += job.lookups
        t.requests_kept = len(self.rows)
        self.last_job = job

    # -- reading ------------------------------------------------------------------------------
    def tok_s(self) -> float:
        now = time.monotonic()
        total = sum(n for t, n in self._buckets if now - t <= RATE_WINDOW_S)
        return total / RATE_WINDOW_S

    def mean_decode_tok_s(self, running: list[Job], mono: float) -> float:
        """Mean decode rate per request: the recent finished ones and the ones decoding now."""
        rates = list(self._decode_rates)
        for j in running:
            if j.first_token_at is not None and len(j.generated) > 1 and mono > j.first_token_at:
                rates.append((len(j.generated) - 1) / (mono - j.first_token_at))
        return sum(rates) / len(rates) if rates else 0.0

    def snapshot(self, sch: Scheduler, all_requests: bool = False) -> MetricsSnapshot:
        """Everything /metrics says, with the live part read from the scheduler and its supervisor."""
        now = time.time()
        mono = time.monotonic()
        sup = sch.sup
        eng = sup.engine
        engine = EngineView(
            state=("ready" if sup.ready else (eng.state if eng else "starting")),  # type: ignore[arg-type]
            model=self.config.served_name, model_path=self.config.model,
            max_context=eng.context if eng and eng.context else None,
            version=str(eng.info.get("engine")) if eng and "engine" in eng.info else None,
            pid=eng.pid if eng else None, restarts=sup.restarts,
            started_at=eng.started_at if eng else None, ready_s=eng.ready_s if eng else None,
            last_error=sup.last_error, log_path=str(sup.launch.log_path) if sup.launch.log_path else None,
            info=dict(eng.info) if eng else {})
        live = self._live(sch, sup, mono)
        rows = list(self.rows) if all_requests else list(self.rows)[:12]
        devices = self._devices(stage_layers(engine.info.get("layer_split")))
        host = hardware.probe_host(eng.pid if eng else None)
        return MetricsSnapshot(time=now, uptime_s=round(now - self.started, 3), engine=engine, live=live,
                               requests=rows, totals=self.totals.model_copy(), devices=devices, host=host,
                               config=self._config_view(), tier=self._tier(), stats=self._stats_view(),
                               parking=self._parking(engine.info))

    def _live(self, sch: Scheduler, sup: EngineSupervisor, mono: float) -> LiveView:
        running = sorted(sch.running, key=lambda j: j.created)
        cj = sch.control_job
        solo = cj if cj is not None and cj.mode == "solo" else None
        if not sup.ready:
            state = "dead" if sup.state == "dead" else "loading"
            phase = "the engine died" if state == "dead" else "loading the model"
        elif any(j.state == "reading" for j in running):
            state, phase = "reading", "reading the prompt"
        elif running:
            state, phase = "generating", "answering"
        else:
            state, phase = "idle", "waiting for requests"
        reader = sch.control_job if sch.control_job is not None and sch.control_job.state == "reading" else None
        slots = []
        for s in sch.slots:
            j = s.job
            if j is None:
                slots.append(SlotView(slot=s.index, state="idle", held_tokens=len(s.held)))
                continue
            el = mono - s.started
            slots.append(SlotView(slot=s.index, state="reading" if j.state == "reading" else "decoding",
                                  prompt_tokens=len(j.prompt), generated=len(j.generated), elapsed_s=round(el, 3),
                                  tok_s=round(s.generated / el, 2) if el > 0 else 0.0,
                                  held_tokens=len(j.context)))
        waiting_for_slot = len(sch.waiting) if sch.slots else 0
        prefill_mean = sum(self._prefill_rates) / len(self._prefill_rates) if self._prefill_rates else 0.0
        return LiveView(
            state=state, phase=phase, queued=len(sch.waiting), running=len(running),
            tok_s=round(self.tok_s(), 2), tok_s_window_s=RATE_WINDOW_S,
            tok_s_mean=round(self.mean_decode_tok_s(running, mono), 2),
            prefill_tok_s=round(reader.prefill_tok_s if reader else 0.0, 2),
            prefill_tok_s_mean=round(prefill_mean, 2),
            prompt_read=reader.prompt_read if reader else 0, prompt_total=reader.prompt_total if reader else 0,
            generated=len(solo.generated) if solo else 0, max_tokens=solo.max_new if solo else 0,
            elapsed_s=round(mono - solo.segment.started, 3) if solo and solo.segment else 0.0,
            parallel=max(1, len(sch.slots)), waiting_for_slot=waiting_for_slot, slots=slots)

    def _devices(self, layers: dict[int, str]) -> list[GpuInfo]:
        gpus = hardware.probe_gpus()
        split = {d.cuda_index: d for d in self.stats.memory} if self.stats else {}
        tier_slots = self.stats.tier.device_slots if self.stats and self.stats.tier else {}
        for g in gpus:
            d = split.get(g.index)
            if d is not None:
                known = d.weights_mib + d.slots_mib + d.kv_mib
                g.split = MemorySplit(weights_mib=d.weights_mib, experts_mib=d.experts_mib, slots_mib=d.slots_mib,
                                      kv_mib=d.kv_mib, free_mib=d.free_mib if d.free_mib is not None else g.free_mib,
                                      other_mib=max(0.0, g.used_mib - known), layers=layers.get(g.index),
                                      expert_slots=tier_slots.get(d.device))
        return gpus

    def _tier(self) -> TierView | None:
        t = self.stats.tier if self.stats else None
        if t is None:
            return None
        served = t.vram + t.pcie + t.cpu
        hit = t.hits / t.lookups if t.hits is not None and t.lookups else (t.vram / served if served else None)
        return TierView(vram_share=round(t.vram / served, 4) if served else 0.0,
                        pcie_share=round(t.pcie / served, 4) if served else 0.0,
                        cpu_share=round(t.cpu / served, 4) if served else 0.0,
                        hit_rate=round(hit, 4) if hit is not None else None, swaps=t.swaps,
                        adapt_rounds=t.adapt_rounds, adapt_wait_ms=t.adapt_wait_ms,
                        adapt_wait_total_ms=t.adapt_wait_total_ms, hot=t.hot,
                        experts_cached=t.experts_cached, experts_total=t.experts_total, mode=t.mode, slots=t.slots,
                        cache_mib=t.cache_mib, cpu_ms=t.cpu_ms, hits=t.hits, lookups=t.lookups,
                        offloaded=t.offloaded)

    def _parking(self, info: dict[str, int | float | str]) -> ParkingView | None:
        p = self.stats.parking if self.stats else None
        limits = (info.get("conversation_cache_mib"), info.get("conversation_cache_slots"))
        if p is None and not all(isinstance(v, int) and v > 0 for v in limits):
            return None  # parking off (or an engine that has none)
        p = p or StatsParking()
        return ParkingView(parked=p.parked, parked_mib=round(p.bytes / 2**20, 3),
                           limit_mib=limits[0] if isinstance(limits[0], int) else None,
                           limit_slots=limits[1] if isinstance(limits[1], int) else None,
                           parks=p.parks, evictions=p.evictions, restores=p.restores,
                           restore_ms_last=p.restore_ms, restore_ms_mean=p.restore_ms_mean,
                           hit_rate=round(p.restores / p.lookups, 4) if p.lookups else None)

    def _stats_view(self) -> StatsView | None:
        s = self.stats
        if s is None:
            return None
        return StatsView(windows=s.windows, rows=s.tokens, ms_per_window=s.window_ms, rows_per_window=s.rows,
                         prefill_tokens=s.prefill_tokens, prefill_ms=s.prefill_ms, slot_tokens=s.slot_tokens,
                         at=self.stats_at)

    def _config_view(self) -> ConfigView:
        data = self.config.model_dump(mode="json", exclude={"api_key"})
        return ConfigView(path=self.config_path, api_key_set=bool(self.config.api_key), **data)

    # -- Prometheus ---------------------------------------------------------------------------
    def prometheus(self, sch: Scheduler) -> bytes:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self, sch))
        return generate_latest(registry)


class _Collector:
    def __init__(self, metrics: Metrics, sch: Scheduler):
        self.m = metrics
        self.sch = sch

    def describe(self) -> list:
        return []

    def collect(self):  # noqa: C901 - one flat list of families
        snap = self.m.snapshot(self.sch)
        t = snap.totals

        def gauge(name: str, doc: str, value: float | None, labels: dict[str, str] | None = None):
            g = GaugeMetricFamily(name, doc, labels=list(labels or {}))
            if value is not None:
                g.add_metric(list((labels or {}).values()), float(value))
            return g

        def counter(name: str, doc: str, value: float):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], float(value))
            return c

        yield gauge("strata_up", "1 when the engine is ready", 1.0 if snap.engine.state == "ready" else 0.0)
        yield gauge("strata_uptime_seconds", "seconds since the server started", snap.uptime_s)
        yield counter("strata_engine_restarts", "engine restarts", snap.engine.restarts)
        yield counter("strata_requests", "requests finished", t.requests)
        yield counter("strata_request_errors", "requests that ended in an error", t.errors)
        yield counter("strata_request_disconnects", "requests whose client left", t.disconnects)
        yield counter("strata_prompt_tokens", "prompt tokens of finished requests", t.prompt_tokens)
        yield counter("strata_prompt_reused_tokens", "prompt tokens reused from the cache", t.reused)
        yield counter("strata_output_tokens", "tokens generated (streamed as they come)", self.m.output_tokens_live)
        yield counter("strata_prompt_seconds", "time spent reading prompts", t.prompt_ms / 1000)
        yield counter("strata_decode_seconds", "time spent decoding", t.decode_ms / 1000)
        yield counter("strata_expert_hits", "routed-expert lookups served from VRAM (decode)", t.hits)
        yield counter("strata_expert_lookups", "routed-expert lookups (decode)", t.lookups)
        live = snap.live
        yield gauge("strata_queued_requests", "requests waiting", live.queued)
        yield gauge("strata_running_requests", "requests on the engine", live.running)
        yield gauge("strata_tokens_per_second", f"generated tokens per second over the last {RATE_WINDOW_S:g} s",
                    live.tok_s)
        yield gauge("strata_prefill_tokens_per_second", "prompt read rate of the current read", live.prefill_tok_s)
        yield gauge("strata_batch_slots", "batch slots the engine runs (1 = one at a time)", live.parallel)
        st = GaugeMetricFamily("strata_slot_state", "1 for the state each slot is in", labels=["slot", "state"])
        for s in live.slots:
            for name in ("idle", "reading", "decoding"):
                st.add_metric([str(s.slot), name], 1.0 if s.state == name else 0.0)
        yield st
        held = GaugeMetricFamily("strata_slot_held_tokens", "tokens a slot holds", labels=["slot"])
        for s in live.slots:
            held.add_metric([str(s.slot)], float(s.held_tokens))
        yield held
        if snap.tier is not None:
            tier = GaugeMetricFamily("strata_expert_tier_share", "share of routed experts served", labels=["tier"])
            for name in ("vram", "pcie", "cpu"):
                tier.add_metric([name], getattr(snap.tier, f"{name}_share"))
            yield tier
            yield gauge("strata_expert_hit_ratio", "VRAM expert cache hit rate", snap.tier.hit_rate)
            yield counter("strata_expert_swaps", "experts swapped by the adaptive tier", snap.tier.swaps)
            yield counter("strata_expert_adapt_rounds", "adaptive tier rounds", snap.tier.adapt_rounds)
            if snap.tier.adapt_wait_total_ms is not None:
                yield counter("strata_expert_adapt_wait_seconds", "time decode windows waited for adapt rounds",
                              snap.tier.adapt_wait_total_ms / 1000)
            yield counter("strata_expert_cpu_seconds", "time computing routed experts on the CPU", snap.tier.cpu_ms / 1000)
        if snap.stats is not None:
            yield counter("strata_windows", "decode windows run", snap.stats.windows)
            yield counter("strata_window_rows", "rows in decode windows", snap.stats.rows)
            if snap.stats.ms_per_window is not None:
                yield gauge("strata_window_seconds", "recent time per window", snap.stats.ms_per_window / 1000)
        if snap.parking is not None:
            pk = snap.parking
            yield gauge("strata_parked_conversations", "conversations parked in host memory", pk.parked)
            yield gauge("strata_parked_bytes", "host memory of the parked conversations", pk.parked_mib * 2**20)
            yield counter("strata_parking_restores", "reads that continued a parked conversation", pk.restores)
            yield counter("strata_parking_evictions", "parked conversations dropped for room", pk.evictions)
            yield gauge("strata_parking_restore_seconds", "time of the last restore", pk.restore_ms_last / 1000)
            yield gauge("strata_parking_hit_ratio", "restores / reads while anything was parked", pk.hit_rate)
        mem = GaugeMetricFamily("strata_gpu_memory_bytes", "GPU memory", labels=["gpu", "kind"])
        for g in snap.devices:
            mem.add_metric([str(g.index), "total"], g.total_mib * 2**20)
            mem.add_metric([str(g.index), "used"], g.used_mib * 2**20)
            if g.split is not None:
                for kind in ("weights", "experts", "slots", "kv"):
                    mem.add_metric([str(g.index), kind], getattr(g.split, f"{kind}_mib") * 2**20)
        yield mem
        util = GaugeMetricFamily("strata_gpu_utilization_ratio", "GPU utilization", labels=["gpu"])
        for g in snap.devices:
            if g.util_pct is not None:
                util.add_metric([str(g.index)], g.util_pct / 100)
        yield util
        pcie = GaugeMetricFamily("strata_gpu_pcie_bytes_per_second", "PCIe traffic (NVML's 20 ms sample)",
                                 labels=["gpu", "direction"])
        for g in snap.devices:
            if g.pcie_to_mib_s is not None and g.pcie_from_mib_s is not None:
                pcie.add_metric([str(g.index), "to_gpu"], g.pcie_to_mib_s * 2**20)
                pcie.add_metric([str(g.index), "from_gpu"], g.pcie_from_mib_s * 2**20)
        yield pcie
        yield gauge("strata_host_cpu_ratio", "host CPU use", snap.host.cpu_pct / 100)
        yield gauge("strata_host_memory_used_bytes", "host RAM in use", snap.host.ram_used_mib * 2**20)
        yield gauge("strata_host_memory_total_bytes", "host RAM", snap.host.ram_total_mib * 2**20)
