"""The GPU expert tier's cache per card: the tier counts its slots per device (STATS `tier.device_slots`),
/metrics puts them on that card's memory split, and the card's legend names the experts part as the
expert cache with its slots. NVML and the GPU tier's layers are stand-ins (no GPU on CI)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from engine.tier import AdaptPolicy
from engine.tier.tier import Tier
from server import hardware
from server.config import RunConfig
from server.metrics import Metrics
from server.metrics_schema import GpuInfo
from tui import preview
from tui.widgets.gpu_card import gpu_segments, legend


def _layer(device: torch.device | None, size: int) -> SimpleNamespace:
    slots = SimpleNamespace(experts=8, size=size)
    if device is not None:
        slots.device = device  # GpuLayerSlots have one; the simulated tier's host slots do not
    return SimpleNamespace(slots=slots)


def test_the_tier_counts_its_slots_per_device() -> None:
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    split = Tier([_layer(cuda0, 3), _layer(cuda0, 2), _layer(cuda1, 4)], AdaptPolicy(), mode="gpu")
    assert split.slots_by_device() == {"cuda:0": 5, "cuda:1": 4}
    assert Tier([_layer(None, 3)], AdaptPolicy()).slots_by_device() == {}


def test_a_card_shows_its_expert_cache_slots(monkeypatch) -> None:
    monkeypatch.setattr(hardware, "probe_gpus", lambda: [
        GpuInfo(index=i, name="H200", total_mib=143771, used_mib=100000, free_mib=43771) for i in (0, 1)])
    metrics = Metrics(RunConfig(model="m.gguf"), None)
    memory = [{"device": f"cuda:{i}", "weights_mib": 9000, "experts_mib": 6000, "slots_mib": 800, "kv_mib": 100}
              for i in (0, 1)]
    metrics.on_stats({"memory": memory, "tier": {"mode": "gpu", "device_slots": {"cuda:0": 2240, "cuda:1": 1120}}})
    cards = metrics._devices({})
    assert [g.split.expert_slots for g in cards] == [2240, 1120]
    text = legend(gpu_segments(cards[1]), cards[1].split.expert_slots).plain
    assert "expert cache 5.9 GiB (1,120 experts)" in text and "■ experts" not in text
    metrics.on_stats({"memory": memory, "tier": {"mode": "resident"}})  # no tier: the experts as they are
    resident = metrics._devices({})[0]
    assert resident.split.expert_slots is None
    assert "experts 5.9 GiB" in legend(gpu_segments(resident)).plain
    assert "expert cache" not in legend(gpu_segments(preview.busy().devices[0])).plain
