"""Fixed /metrics snapshots: the snapshot tests, the docs screenshot and `python -m tui.preview`.

Times are fixed (`T0`), so screens drawn from these are byte-for-byte repeatable.
"""

from __future__ import annotations

import sys
from typing import Any

from server.metrics_schema import MetricsSnapshot

T0 = 1_780_000_000.0  # a fixed "now"


def _base() -> dict[str, Any]:
    return {
        "time": T0,
        "uptime_s": 3 * 3600 + 17 * 60 + 42,
        "engine": {
            "state": "ready", "model": "Qwen3-30B-A3B-Q4_K_M", "model_path": "/models/Qwen3-30B-A3B-Q4_K_M.gguf",
            "max_context": 32768, "version": "0.1.0", "pid": 4242, "started_at": T0 - 11862, "ready_s": 41.5,
            "log_path": None,
            "info": {"engine": "0.1.0", "context": 32768, "batch_slots": 4, "batch_groups": 1,
                     "experts": 128, "unsupported": "batch_mtp"},
        },
        "live": {"state": "idle", "phase": "idle", "parallel": 4, "tok_s_mean": 71.4, "prefill_tok_s_mean": 2430.0,
                 "slots": [
                     {"slot": 0, "state": "idle", "held_tokens": 1834},
                     {"slot": 1, "state": "idle", "held_tokens": 912},
                     {"slot": 2, "state": "idle", "held_tokens": 0},
                     {"slot": 3, "state": "idle", "held_tokens": 0},
                 ]},
        "requests": [
            {"id": "r12", "time": T0 - 14, "duration_s": 6.2, "ttft_s": 0.41, "finish": "stop", "prompt_tokens": 1834,
             "reused": 1620, "output_tokens": 412, "decode_tok_s": 72.3, "path": "solo"},
            {"id": "r11", "time": T0 - 95, "duration_s": 12.9, "ttft_s": 0.62, "finish": "stop", "prompt_tokens": 912,
             "reused": 0, "output_tokens": 730, "decode_tok_s": 58.1, "path": "solo+slot", "slot": 1},
            {"id": "r10", "time": T0 - 140, "duration_s": 3.3, "ttft_s": 0.38, "finish": "length",
             "prompt_tokens": 220, "output_tokens": 256, "decode_tok_s": 80.4, "path": "solo"},
            {"id": "r09", "time": T0 - 301, "duration_s": 1.1, "ttft_s": 0.52, "finish": "disconnect",
             "prompt_tokens": 5120, "output_tokens": 12, "decode_tok_s": 0.0, "path": "slot", "slot": 2},
        ],
        "totals": {"since": T0 - 11862, "requests": 12, "prompt_tokens": 18211, "reused": 4410,
                   "output_tokens": 5320, "errors": 0},
        "devices": [{
            "index": 0, "name": "NVIDIA GeForce RTX 4090", "total_mib": 24564, "used_mib": 21650, "free_mib": 2914,
            "util_pct": 3, "temp_c": 41, "power_w": 38, "power_limit_w": 450,
            "split": {"weights_mib": 2310, "experts_mib": 15872, "slots_mib": 2240, "kv_mib": 512,
                      "free_mib": 2914, "other_mib": 716},
        }],
        "host": {"cpu_pct": 4.0, "cpu_count": 16, "ram_total_mib": 65536, "ram_used_mib": 23800,
                 "ram_available_mib": 41736, "engine_rss_mib": 17900},
        "config": {"path": "/home/u/.config/strata-desk/strata-qwen3-30b-a3b-q4_k_m.json",
                   "model": "/models/Qwen3-30B-A3B-Q4_K_M.gguf", "port": 8080, "parallel": 4,
                   "adapt_every": 4, "adapt_swaps": 8, "adapt_decay": 0.9, "adapt_min_gain": 1.5, "context": 32768},
        "tier": {"vram_share": 0.874, "pcie_share": 0.061, "cpu_share": 0.065, "hit_rate": 0.874, "swaps": 1536,
                 "adapt_rounds": 211, "adapt_wait_ms": 0.3, "experts_cached": 4480, "experts_total": 6144},
        "stats": {"windows": 9120, "rows": 15800, "ms_per_window": 21.4, "rows_per_window": 1.7, "at": T0 - 0.4},
    }


def idle() -> MetricsSnapshot:
    return MetricsSnapshot.model_validate(_base())


def busy() -> MetricsSnapshot:
    data = _base()
    data["live"].update({
        "state": "generating", "phase": "answering", "running": 4, "queued": 2, "waiting_for_slot": 2,
        "tok_s": 183.6, "prefill_tok_s": 2310.0,
        "slots": [
            {"slot": 0, "state": "decoding", "prompt_tokens": 1834, "generated": 312, "elapsed_s": 7.4, "tok_s": 47.2},
            {"slot": 1, "state": "decoding", "prompt_tokens": 912, "generated": 88, "elapsed_s": 2.1, "tok_s": 45.9},
            {"slot": 2, "state": "reading", "prompt_tokens": 5120, "generated": 0, "elapsed_s": 1.3, "tok_s": 0},
            {"slot": 3, "state": "decoding", "prompt_tokens": 244, "generated": 1203, "elapsed_s": 25.8,
             "tok_s": 44.6},
        ],
    })
    data["devices"][0].update({"util_pct": 97, "temp_c": 71, "power_w": 388, "used_mib": 22010, "free_mib": 2554})
    data["devices"][0]["split"].update({"kv_mib": 872, "free_mib": 2554})
    data["host"]["cpu_pct"] = 38.0
    data["devices"][0].update({"pcie_to_mib_s": 2310.0, "pcie_from_mib_s": 38.0})
    data["devices"][0]["split"]["expert_slots"] = 4480
    data["tier"].update({"vram_share": 0.842, "pcie_share": 0.071, "cpu_share": 0.087, "hit_rate": 0.842,
                         "mode": "gpu", "hot": BUSY_HOT, **busy_tier_totals(BUSY_POLLS)})
    data["stats"]["at"] = T0 - 0.4
    return MetricsSnapshot.model_validate(data)


BUSY_POLLS = 60  # busy_history's snapshots before busy()
BUSY_HOT = [{"layer": 11, "expert": 87, "share": 0.094, "cached": True},
            {"layer": 3, "expert": 5, "share": 0.081, "cached": True},
            {"layer": 40, "expert": 19, "share": 0.077, "cached": False},
            {"layer": 27, "expert": 112, "share": 0.069, "cached": True}]


def busy_tier_totals(poll: int) -> dict[str, Any]:
    """The GPU tier's totals at `poll` (one engine report a second): 4,800 lookups a report, 84.2% from
    VRAM and 7.1% over PCIe, 2 adapt rounds and 6 swaps a report."""
    lookups = 4800 * (100 + poll)
    return {"lookups": lookups, "hits": round(lookups * 0.842), "offloaded": round(lookups * 0.071),
            "swaps": 1176 + 6 * poll, "adapt_rounds": 91 + 2 * poll, "adapt_wait_total_ms": round(0.6 * (100 + poll), 1)}


def busy_history() -> list[MetricsSnapshot]:
    """60 snapshots ramping up into `busy()`, so the sparklines have a shape."""
    out = []
    for i in range(BUSY_POLLS):
        snap = busy()
        for key, value in busy_tier_totals(i).items():
            setattr(snap.tier, key, value)
        snap.stats.at = T0 - 0.4 - (BUSY_POLLS - i)
        factor = min(1.0, 0.15 + i / 40) * (0.92 + 0.08 * ((i * 7) % 5) / 4)
        snap.live.tok_s = round(183.6 * factor, 1)
        for slot in snap.live.slots:
            if slot.state == "decoding":
                slot.tok_s = round(slot.tok_s * factor, 1)
        out.append(snap)
    out.append(busy())
    return out


def dead() -> MetricsSnapshot:
    data = _base()
    data["engine"].update({"state": "dead", "restarts": 2,
                           "last_error": "engine exited with code 3: CUDA error: out of memory"})
    data["live"].update({"state": "dead", "phase": "", "slots": []})
    return MetricsSnapshot.model_validate(data)


def cpu_dense() -> MetricsSnapshot:
    data = _base()
    data["engine"]["model"] = "gemma-3-270m-it-Q4_K_M"
    data["engine"]["info"] = {"engine": "0.1.0", "context": 4096, "experts": 0, "tier": "dense"}
    data["live"].update({"parallel": 1, "slots": []})
    data["devices"] = []
    data["tier"] = None
    return MetricsSnapshot.model_validate(data)


MOE_WINDOWS = 31  # engine reports (STATS) of the simulated tier, 2 s apart; the last is cpu_moe_simulated's
MOE_LOOKUPS = 1200  # routed-expert lookups between two reports


def moe_window_rate(window: int) -> float:
    """The simulated cache's hit rate in `window`: 20% cold, 90% once the adapt rounds filled it."""
    return round(0.2 + 0.7 * min(1.0, window / 20), 4)


MOE_ROUNDS = 4  # adapt rounds between two reports
MOE_WAIT_MS = 1.6  # what the decode windows waited for them


def moe_window_swaps(window: int) -> int:
    """Experts the adapt rounds copied into slots in `window`: many while the cache fills, then few."""
    return 4 if window < 10 else 1


MOE_HOT = [{"layer": 0, "expert": 3, "share": 0.31, "cached": True}, {"layer": 2, "expert": 11, "share": 0.27, "cached": True},
           {"layer": 1, "expert": 7, "share": 0.22, "cached": True}, {"layer": 3, "expert": 0, "share": 0.19, "cached": False}]


def cpu_moe_simulated(window: int = MOE_WINDOWS - 1) -> MetricsSnapshot:
    """The `--demo moe` shape on a machine without a GPU: a generated qwen3moe model whose experts
    run from the simulated tier (`--expert-cache N`), two slots decoding; the tier's totals as
    they are after `window` engine reports (the last by default)."""
    data = _base()
    data["engine"].update({"model": "strata-test-qwen3moe", "model_path": "/cache/strata-test-qwen3moe.gguf",
                           "max_context": 4096})
    data["engine"]["info"] = {
        "engine": "0.1.0", "context": 4096, "device": "cpu", "batch_slots": 2, "batch_groups": 1, "experts": 16,
        "experts_used": 2, "layers": 4, "tier": "simulated", "expert_slots": 24, "experts_cached": 24,
        "adapt_every": 4, "generated": 1, "unsupported": "batch_groups,batch_mtp,pcie_frac,layer_split",
    }
    data["live"].update({
        "state": "generating", "phase": "answering", "parallel": 2, "running": 2, "tok_s": 31.5,
        "tok_s_mean": 15.8, "prefill_tok_s_mean": 410.0,
        "slots": [
            {"slot": 0, "state": "decoding", "prompt_tokens": 40, "generated": 180, "elapsed_s": 6.1, "tok_s": 15.9},
            {"slot": 1, "state": "decoding", "prompt_tokens": 52, "generated": 95, "elapsed_s": 3.2, "tok_s": 15.6},
        ],
    })
    data["devices"] = []
    data["host"].update({"cpu_pct": 97.0, "cpu_count": 2, "ram_total_mib": 7900, "ram_used_mib": 2100,
                         "ram_available_mib": 5800, "engine_rss_mib": 610})
    data["config"].update({"model": "/cache/strata-test-qwen3moe.gguf", "parallel": 2, "context": 4096,
                           "adapt_every": 4, "adapt_swaps": 96, "adapt_decay": 0.7})
    hits = sum(round(MOE_LOOKUPS * moe_window_rate(k)) for k in range(window + 1))
    lookups = MOE_LOOKUPS * (window + 1)
    rate = round(hits / lookups, 4)
    data["tier"] = {"mode": "simulated", "vram_share": rate, "pcie_share": 0.0, "cpu_share": round(1 - rate, 4),
                    "hit_rate": rate, "hits": hits, "lookups": lookups, "offloaded": 0,
                    "swaps": sum(moe_window_swaps(k) for k in range(window + 1)),
                    "adapt_rounds": MOE_ROUNDS * (window + 1), "adapt_wait_ms": round(MOE_WAIT_MS * (window + 1) / 560, 2),
                    "adapt_wait_total_ms": round(MOE_WAIT_MS * (window + 1), 1), "hot": MOE_HOT,
                    "experts_cached": 24, "experts_total": 64, "slots": 24, "cache_mib": 3.0, "cpu_ms": 1840.0}
    data["stats"] = {"windows": 560, "rows": 1090, "ms_per_window": 62.5, "rows_per_window": 2.0,
                     "at": T0 - 0.3 - 2.0 * (MOE_WINDOWS - 1 - window)}
    return MetricsSnapshot.model_validate(data)


def cpu_moe_history() -> list[MetricsSnapshot]:
    """The simulated tier's engine reports while its cache warms up (the hit rate of each window
    climbs from 20% to 90% as the adapt rounds fill the slots), the last one `cpu_moe_simulated()`."""
    return [cpu_moe_simulated(window) for window in range(MOE_WINDOWS)]


SAMPLE_LOG = [
    ("server", "09:14:02 [strata] starting the engine: python -m engine --serve --model Qwen3-30B-A3B-Q4_K_M.gguf "
               "--batch 4"),
    ("engine", "09:14:43 strata serve: expert cache 4480 slots, 15.5 GiB; 2914 MiB of VRAM free with everything "
               "loaded"),
    ("server", "09:14:43 [strata] engine ready in 41.5 s: context 32768 (batch_slots=4 batch_groups=1)"),
    ("server", "09:14:43 [strata] ready: http://127.0.0.1:8080/v1 (model Qwen3-30B-A3B-Q4_K_M)"),
    ("server", "12:31:30 [strata] 200 POST /v1/chat/completions from 192.168.1.20 in 6.20 s: prompt 1834 "
               "(1620 reused), out 412 (72.3 tok/s, stop, solo)"),
    ("server", "12:31:41 [strata] 401 POST /v1/chat/completions from 192.168.1.31 in 0 ms"),
    ("engine", "12:31:43 strata batch: 4 rows in 21.4 ms; adapt 1 round, 8 swaps; VRAM 84% PCIe 7% CPU 9%"),
]


def write_screenshot(path: str, size: tuple[int, int] = (130, 40)) -> str:
    """Save the busy dashboard as an SVG (docs/screenshot.svg), drawn by Textual itself."""
    from textual._doc import take_svg_screenshot

    from tui.app import StrataDeskApp
    from tui.client import FixedSource

    history = busy_history()
    app = StrataDeskApp(attach_url="http://127.0.0.1:8080", source=FixedSource(history[-1]), poll_interval=3600)
    for snap in history[:-1]:
        app.history.push(snap)
    for source, text in SAMPLE_LOG:
        app.logbuf.add(source, text)

    async def settle(pilot) -> None:  # type: ignore[no-untyped-def]
        while app.snapshot is None:
            await pilot.pause(0.05)
        await pilot.pause()
        app.screen.set_focus(None)

    svg = take_svg_screenshot(app, terminal_size=size, run_before=settle, title="strata-desk")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(svg)
    return path


def main() -> None:  # pragma: no cover - manual preview
    """`python -m tui.preview [busy|idle|dead|dense|moe]` shows fixed data; `--screenshot FILE` saves one."""
    from tui.app import StrataDeskApp
    from tui.client import FixedSource

    if len(sys.argv) > 2 and sys.argv[1] == "--screenshot":
        print(write_screenshot(sys.argv[2]))
        return
    kind = sys.argv[1] if len(sys.argv) > 1 else "busy"
    snaps = {"idle": [idle()], "busy": busy_history(), "dead": [dead()], "dense": [cpu_dense()],
             "moe": cpu_moe_history()}[kind]
    app = StrataDeskApp(attach_url="http://127.0.0.1:8080", source=FixedSource(*snaps), poll_interval=0.2)
    for source, text in SAMPLE_LOG:
        app.logbuf.add(source, text)
    app.run()


if __name__ == "__main__":
    main()
