"""Conversation parking through the HTTP server (the real engine on a HashLM model): more alternating
conversations than free slots keep their follow-ups from reading their history again, counted by
the engine (its admission log's `reused`), and /metrics shows the parked conversations."""

from __future__ import annotations

import threading
import time

import pytest
from test_server_harness import LiveServer, chat_ids, user

from engine.hashlm import Rule
from server.metrics_schema import MetricsSnapshot, ParkingView


def busy_slot(s: LiveServer, done: threading.Event) -> threading.Thread:
    """A long streamed request that keeps one of the two slots decoding while the conversations take
    turns; it leaves (its client closes the stream) when `done` is set."""

    def run() -> None:
        body = {"messages": user("keep a slot busy"), "max_tokens": 4000, "stream": True}
        with s.client.stream("POST", "/v1/chat/completions", json=body) as r:
            for _ in r.iter_lines():
                if done.is_set():
                    return

    t = threading.Thread(target=run, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and MetricsSnapshot.model_validate(s.metrics()).live.state != "generating":
        time.sleep(0.02)
    return t


def parking_after(s: LiveServer, restores: int) -> ParkingView | None:
    """/metrics' parking once the engine's STATS has counted `restores` (STATS comes every 0.25 s)."""
    deadline = time.monotonic() + 5
    while True:
        p = MetricsSnapshot.model_validate(s.metrics()).parking
        if p is None or p.restores >= restores or time.monotonic() > deadline:
            return p
        time.sleep(0.05)


def test_alternating_conversations_reuse_their_history(tmp_path):
    with LiveServer(tmp_path, config={"parallel": 2}, switches={"tok_s": 400}, rule=Rule(ends=False)) as s:
        done = threading.Event()
        busy = busy_slot(s, done)
        convs = {name: user(f"conversation {name}: " + f"{name}{name} words " * 20) for name in "abc"}
        first = {name: s.chat(msgs, 8)["choices"][0]["message"]["content"] for name, msgs in convs.items()}
        for name, msgs in convs.items():
            follow = [*msgs, {"role": "assistant", "content": first[name]}, {"role": "user", "content": "go on"}]
            got = s.chat(follow, 8)["choices"][0]["message"]["content"]
            assert got == s.expected_chat(follow, 8)[0]
        done.set()
        follow_ups = [a for a in s.admissions() if a["kind"] == "BGEN" and a["slot"] == 1][-3:]
        # each follow-up took the one free slot, held by another conversation, and read only its new turn
        history = [len(chat_ids(msgs)) for msgs in convs.values()]
        assert all(a["reused"] >= n for a, n in zip(follow_ups, history, strict=True)), follow_ups
        p = parking_after(s, 3)
        assert p is not None and p.restores == 3 and p.parked >= 2 and p.parked_mib > 0
        assert p.limit_mib == 2048 and p.limit_slots == 8 and p.hit_rate is not None and p.restore_ms_last >= 0
        busy.join(10)


def test_metrics_view_and_config_flags():
    from server.config import RunConfig
    from server.metrics import Metrics

    m = Metrics(RunConfig(model="m.gguf"), None)
    on = {"conversation_cache_mib": 2048, "conversation_cache_slots": 8}
    assert m._parking({"conversation_cache_mib": 0, "conversation_cache_slots": 8}) is None  # off
    assert m._parking(on).parked == 0 and m._parking(on).hit_rate is None  # on, no STATS yet
    m.on_stats({"parking": {"parked": 2, "bytes": 3 << 20, "parks": 5, "lookups": 4, "restores": 3,
                            "restore_ms": 1.5, "restore_ms_mean": 2.0}})
    p = m._parking(on)
    assert (p.parked, p.parked_mib, p.parks, p.restores, p.hit_rate) == (2, 3.0, 5, 3, 0.75)
    assert (p.restore_ms_last, p.restore_ms_mean, p.limit_mib, p.limit_slots) == (1.5, 2.0, 2048, 8)
    args = RunConfig(model="m.gguf", conversation_cache_mib=0, layer_split="24").engine_args()
    assert args[args.index("--conversation-cache-mib") + 1] == "0"
    assert args[args.index("--conversation-cache-slots") + 1] == "8"
    assert args[args.index("--layer-split") + 1] == "24"
    with pytest.raises(ValueError, match="conversation_cache_slots"):
        RunConfig(model="m.gguf", conversation_cache_slots=-1)
