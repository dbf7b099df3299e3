"""strata_desk.setup: the seed's parallel recommendation (table-driven) and config building."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine.gguf_file import split_parts
from strata_desk import paths
from strata_desk.modelfacts import GIB, ModelFacts
from strata_desk.probe import GpuInfo, HardwareInfo
from strata_desk.setup import COST_NOTE, SetupError, build_config, expert_tier, recommend, write_config


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv(paths.HOME_ENV, str(tmp_path / "home"))


def write_tiny_gguf(path: Path, *, layers: int = 2, experts: int = 8, context: int = 2048) -> Path:
    """A header-only-sized qwen3moe GGUF with a few zero tensors (enough for ModelFacts)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_block_count(layers)
    writer.add_context_length(context)
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_key_length(16)
    writer.add_value_length(16)
    writer.add_expert_count(experts)
    writer.add_expert_used_count(2)
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.ffn_gate_exps.weight", np.zeros((experts, 32, 64), dtype=np.float32))
        writer.add_tensor(f"blk.{i}.attn_q.weight", np.zeros((64, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# Q2_0-like facts from the seed: one slot = 0.5625 GiB at 32K (12 layers x 3 KV heads x 128 x bf16),
# routed experts 34 GiB, so 24 GB -> 3 slots, 32 GB and 2 x 16 GB -> 4, any 12/16 GB card alone -> 1.
Q2 = ModelFacts("qwen35moe", n_layers=12, n_kv_heads=3, head_dim=128, n_experts=256, n_experts_used=8,
                expert_bytes=34 * GIB, total_bytes=36 * GIB, context_length=262144)
# Qwen3-30B-A3B-like: bf16 KV is 96 KiB per token (3 GiB per slot at 32K), experts ~16.5 GiB.
QWEN3 = ModelFacts("qwen3moe", n_layers=48, n_kv_heads=4, head_dim=128, n_experts=128, n_experts_used=8,
                   expert_bytes=int(16.5 * GIB), total_bytes=int(17.3 * GIB), context_length=40960)


@pytest.mark.parametrize(
    ("vram", "facts", "context", "expected", "device"),
    [
        ([12.0], Q2, 32768, 1, "cuda"),
        ([16.0], Q2, 32768, 1, "cuda"),
        ([24.0], Q2, 32768, 3, "cuda"),
        ([32.0], Q2, 32768, 4, "cuda"),
        ([16.0, 16.0], Q2, 32768, 4, "cuda"),
        ([], Q2, 32768, 1, "cpu"),
        ([24.0], QWEN3, 32768, 1, "cuda"),  # two 3 GiB slots exceed a fifth of a 19 GiB cache
        ([24.0], QWEN3, 8192, 4, "cuda"),  # 0.75 GiB slots: four fit
        ([32.0], QWEN3, 32768, 1, "cuda"),  # 27 GiB cache: a fifth is 5.4 < 6
        ([16.0, 16.0], QWEN3, 16384, 2, "cuda"),  # 1.5 GiB slots, 22 GiB cache: 2 (3 would be 4.5 > 4.4)
        ([4.0], Q2, 32768, 1, "cuda"),  # below the reserve: no cache at all
    ],
)
def test_recommend_table(vram, facts, context, expected, device):
    rec = recommend(vram, facts, context)
    assert rec.parallel == expected
    assert rec.device == device
    assert rec.cache_gib == pytest.approx(sum(max(0.0, v - 5.0) for v in vram))
    assert rec.slot_gib == pytest.approx(facts.kv_bytes_per_token() * context / GIB)


def test_recommend_messages():
    assert recommend([24.0], Q2, 32768).messages[0].startswith("parallel 3 recommended")
    for vram in ([12.0], [16.0]):
        messages = recommend(vram, Q2, 32768).messages
        assert COST_NOTE in messages
        assert "half of the model's experts" in messages[0]
    assert "a fifth" in recommend([24.0], QWEN3, 32768).messages[0]
    cpu = recommend([], Q2, 32768).messages
    assert "CPU" in cpu[0] and COST_NOTE not in cpu


def test_seed_message_text():
    assert COST_NOTE == ("parallel N reduces waiting for several users but costs about 10-25% speed "
                         "per request on this card")


def test_kv_bytes_formula():
    assert QWEN3.kv_bytes_per_token() == 2 * 48 * 4 * 128 * 2
    assert Q2.slot_bytes(32768) == pytest.approx(0.5625 * GIB)


def test_model_facts_from_gguf(tmp_path):
    model = write_tiny_gguf(tmp_path / "Tiny-MoE.gguf", layers=3, experts=4)
    facts = ModelFacts.from_gguf(model)
    assert (facts.architecture, facts.n_layers, facts.n_kv_heads, facts.head_dim) == ("qwen3moe", 3, 2, 16)
    assert facts.n_experts == 4 and facts.n_experts_used == 2
    assert facts.expert_bytes == 3 * 4 * 32 * 64 * 4
    assert facts.layer_expert_bytes == 4 * 32 * 64 * 4 and facts.dense_bytes == 3 * 64 * 64 * 4
    assert facts.total_bytes == model.stat().st_size
    assert facts.context_length == 2048


def test_split_parts():
    parts = split_parts(Path("/m/Big-Q4-00001-of-00003.gguf"))
    assert [p.name for p in parts] == [f"Big-Q4-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert split_parts(Path("/m/one.gguf")) == [Path("/m/one.gguf")]


def _probe(*vram: float):
    gpus = [GpuInfo(i, "Test GPU", v) for i, v in enumerate(vram)]
    return lambda: HardwareInfo(gpus=gpus, ram_gib=64.0, cpu_name="Test CPU", cpu_cores=8)


def test_build_config_cpu(tmp_path):
    model = write_tiny_gguf(tmp_path / "Tiny.gguf")
    config, messages = build_config(model, probe=_probe())
    assert config.parallel == 1
    assert config.context == 2048  # the model's trained context, below the 32K default cap
    assert config.model == str(model.resolve())
    assert any("CPU" in m for m in messages)
    assert any("no NVIDIA GPU" in m for m in messages)
    assert config.prefill == 512  # the CPU's chunk


def test_build_config_keeps_asked_parallel_with_note(tmp_path):
    model = write_tiny_gguf(tmp_path / "Tiny.gguf")
    config, messages = build_config(model, parallel=3, probe=_probe())
    assert config.parallel == 3
    assert any("recommended for this machine: 1; kept as you chose (3)" in m for m in messages)
    config, messages = build_config(model, parallel=8, context=1024, probe=_probe(24.0))
    assert config.parallel == 8 and config.context == 1024


def test_build_config_refuses_parallel_above_the_engine_limit(tmp_path):
    """One rule everywhere: RunConfig's limit (8 slots); nothing is clamped silently."""
    model = write_tiny_gguf(tmp_path / "Tiny.gguf")
    with pytest.raises(SetupError, match=r"1\.\.8"):
        build_config(model, parallel=12, probe=_probe(24.0))


def test_build_config_gpu_recommends(tmp_path):
    model = write_tiny_gguf(tmp_path / "Tiny.gguf")
    config, messages = build_config(model, probe=_probe(24.0))
    assert config.parallel == 4  # a tiny model: everything fits
    assert any(m.startswith("parallel 4 recommended") for m in messages)
    assert config.prefill == "auto" and any("(prefill auto, up to 8192 tokens)" in m for m in messages)
    assert config.engine_command_line()[config.engine_command_line().index("--prefill") + 1] == "auto"


# Qwen3-30B-A3B Q4_K_M-like with its file's split: 16.5 GiB of routed experts over 48 layers, 0.8 GiB else
QWEN3_FILE = ModelFacts("qwen3moe", n_layers=48, n_kv_heads=4, head_dim=128, n_experts=128, n_experts_used=8,
                        expert_bytes=int(16.5 * GIB), layer_expert_bytes=int(16.5 * GIB / 48),
                        dense_bytes=int(0.8 * GIB), total_bytes=int(17.3 * GIB), context_length=40960)


@pytest.mark.parametrize(("vram", "parallel", "cache", "share"), [
    ([24.0], 1, None, None),  # 24 - 0.8 - 2 x 0.75 (sessions) - 0.5 - 0.68 = 20.5 GiB of room: all fit
    ([16.0], 1, "auto", "(74%)"),  # 12.5 GiB of room less 0.34 of staging
    ([12.0], 2, "auto", "(45%)"),
    ([80.0], 4, None, None),  # every expert fits
    ([140.0, 140.0], 8, None, None),
])
def test_expert_tier_when_the_experts_do_not_fit(vram, parallel, cache, share):
    got, why = expert_tier(vram, QWEN3_FILE, parallel, 8192)
    assert got == cache
    assert (share in why) if share else ("no expert tier" in why)


def test_build_config_sets_the_tier_only_on_a_gpu_and_keeps_a_chosen_one(tmp_path, monkeypatch):
    from strata_desk import setup

    model = write_tiny_gguf(tmp_path / "Tiny.gguf")
    monkeypatch.setattr(ModelFacts, "from_gguf", classmethod(lambda cls, path: QWEN3_FILE))
    config, messages = build_config(model, context=8192, probe=_probe(12.0))
    assert config.expert_cache == "auto" and any("expert tier (expert_cache auto)" in m for m in messages)
    assert build_config(model, context=8192, probe=_probe())[0].expert_cache is None  # the CPU: resident
    setup.write_config(config.model_copy(update={"expert_cache": 200}))
    assert build_config(model, context=8192, probe=_probe(12.0))[0].expert_cache == 200


def test_prefill_auto_only_without_sliding_window_layers(tmp_path, monkeypatch):
    """On a GPU setup writes prefill auto, except for a model with sliding-window layers (their rings would
    hold window + 8192 positions in every session) and where the config sets a chunk."""
    import dataclasses

    from strata_desk import setup

    model = write_tiny_gguf(tmp_path / "Tiny.gguf")
    monkeypatch.setattr(ModelFacts, "from_gguf", classmethod(lambda cls, path: QWEN3_FILE))
    config, _ = build_config(model, context=8192, probe=_probe(24.0))
    assert config.prefill == "auto"
    setup.write_config(config.model_copy(update={"prefill": 2048}))
    assert build_config(model, context=8192, probe=_probe(24.0))[0].prefill == 2048
    sliding = dataclasses.replace(QWEN3_FILE, windows=(1024, None) * 24)
    monkeypatch.setattr(ModelFacts, "from_gguf", classmethod(lambda cls, path: sliding))
    assert build_config(write_tiny_gguf(tmp_path / "Other.gguf"), context=8192, probe=_probe(24.0))[0].prefill == 512


def test_build_config_errors(tmp_path):
    with pytest.raises(SetupError, match="model file not found"):
        build_config(tmp_path / "missing.gguf", probe=_probe())
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(SetupError, match="not a GGUF"):
        build_config(bad, probe=_probe())
    model = write_tiny_gguf(tmp_path / "Tiny.gguf")
    with pytest.raises(SetupError, match="--context"):
        build_config(model, context=100, probe=_probe())


def test_write_config_and_reuse(tmp_path):
    model = write_tiny_gguf(tmp_path / "My Model-Q4_K_M.gguf")
    config, _ = build_config(model, probe=_probe())
    path = write_config(config)
    assert path == paths.config_dir() / "strata-my-model-q4_k_m.json"
    assert paths.last_config() == path
    data = json.loads(path.read_text())
    data["port"] = 9999
    path.write_text(json.dumps(data))
    config, messages = build_config(model, parallel=2, probe=_probe())
    assert config.port == 9999 and config.parallel == 2
    assert any("updating" in m for m in messages)
    write_config(config)
    assert path.with_name(path.name + ".bak").is_file()


def test_probe_uses_server_hardware(monkeypatch):
    from server.metrics_schema import GpuInfo as ServerGpu
    from strata_desk import probe

    monkeypatch.setattr(probe, "probe_gpus", lambda: [
        ServerGpu(index=0, name="RTX 5070", total_mib=12 * 1024, used_mib=0, free_mib=0),
        ServerGpu(index=1, name="H200", total_mib=143771, used_mib=0, free_mib=0)])
    hw = probe.probe_hardware()
    assert [g.name for g in hw.gpus] == ["RTX 5070", "H200"]
    assert hw.gpu_vram_gib == pytest.approx([12.0, 140.4], abs=0.05)
    assert hw.ram_gib > 0 and hw.cpu_cores > 0
    assert recommend(hw.gpu_vram_gib, QWEN3, 32768).parallel == 4


def test_probe_without_gpus_never_raises():
    from strata_desk.probe import probe_hardware

    hw = probe_hardware()  # this machine: no NVIDIA driver
    assert isinstance(hw.gpus, list) and hw.lines()


def test_build_config_on_the_generated_test_model(tiny_model):
    """The project's own tiny qwen3moe model (tests/conftest.py): its header reads as a MoE model."""
    facts = ModelFacts.from_gguf(tiny_model)
    assert facts.architecture == "qwen3moe" and not facts.dense
    assert facts.n_experts >= 2 and 0 < facts.expert_bytes < facts.total_bytes
    assert facts.kv_bytes_per_token() > 0
    config, messages = build_config(tiny_model, probe=_probe(24.0))
    assert config.parallel == 4 and config.model == str(tiny_model.resolve())
    assert any("MiB" in m for m in messages)


def test_slot_bytes_count_sliding_window_rings(demo_model):
    """Gemma 3: 15 of 18 layers keep a ring of window + prefill positions, not the whole context,
    as the engine's cache does."""
    import torch

    from engine.gguf_file import GGUFFile
    from engine.loading import session_bytes

    facts = ModelFacts.from_gguf(demo_model)
    assert facts.windows.count(None) == 3
    engine_bytes = session_bytes(GGUFFile(demo_model), 32768, 512, torch.float16)
    assert facts.slot_bytes(32768) == engine_bytes
    assert facts.slot_bytes(32768) < facts.kv_bytes_per_token() * 32768 / 4
