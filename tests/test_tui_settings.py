"""The settings form against today's engine: which options would have no effect as the form stands
(no expert cache, a dense model, the simulated tier's pcie_frac, a round's options while adapt_every
is 0, one parking limit at 0, groups without batch slots), the notes following each keystroke; the
expert cache and parking rows edit the config's values. Fixed snapshots (`tui.preview`), no server."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError
from textual.app import App

from server.config import RunConfig
from server.metrics_schema import MetricsSnapshot
from tui import preview
from tui.screens.settings import SettingsScreen
from tui.view import NO_EFFECT, option_notes

NO_CACHE = NO_EFFECT + "no expert cache (expert-cache empty: every expert stays in memory)"
DENSE = NO_EFFECT + "a dense model has no routed experts"
SIMULATED_PCIE = NO_EFFECT + "the simulated tier (no GPU) reads nothing over PCIe, it runs 0"
NO_GRAPHS = NO_EFFECT + "CUDA graphs replay GPU work; the CPU runs every window as it comes"
STATIC = NO_EFFECT + "adapt-every is 0: the cache stays as seeded"
TIER = {"adapt_every", "adapt_swaps", "adapt_decay", "adapt_min_gain", "adapt_min_count", "adapt_async", "pcie_frac",
        "prefill_borrow", "mmap_experts"}
ROUND = {"adapt_swaps", "adapt_decay", "adapt_min_gain", "adapt_min_count", "adapt_async"}


def test_option_notes() -> None:
    gpu = preview.busy().engine  # a MoE model on a GPU
    data = RunConfig(model="m.gguf").model_dump()
    assert option_notes(data, gpu) == dict.fromkeys(TIER, NO_CACHE)
    assert option_notes({**data, "expert_cache": "auto"}, gpu) == {}  # every tier option runs on the GPU tier
    assert option_notes({**data, "expert_cache": 24, "adapt_every": 0}, gpu) == dict.fromkeys(ROUND, STATIC)
    assert option_notes({**data, "expert_cache": 24, "adapt_every": 1_000_000}, gpu) == dict.fromkeys(
        ROUND, NO_EFFECT + "adapt-every 1,000,000: a fixed cache (no round comes), as 0 is")
    assert option_notes({**data, "expert_cache": 24, "adapt_every": 999_999}, gpu) == {}
    cpu = preview.cpu_moe_simulated().engine
    notes = option_notes({**data, "expert_cache": 24}, cpu)
    assert set(notes) == {"expert_cache", "pcie_frac", "prefill_borrow", "mmap_experts", "cuda_graphs", "cpu_plans",
                          "dense_copies"}
    assert notes["dense_copies"] == NO_EFFECT + "dense copies speed up GPU products; the CPU reads the blocks"
    assert option_notes({**data, "expert_cache": "auto", "exact": True}, gpu) == {
        "dense_copies": NO_EFFECT + "exact mode keeps no copies (torch's products depend on the rows)"}
    assert "expert tier" in notes["cpu_plans"]
    assert notes["pcie_frac"] == SIMULATED_PCIE and "no VRAM to lend" in notes["prefill_borrow"]
    assert notes["cuda_graphs"] == NO_GRAPHS
    assert "does not make the CPU faster" in notes["expert_cache"]
    # before an engine has said anything, the config's device stands for it
    assert option_notes({**data, "expert_cache": 24, "device": "cpu"}, None)["pcie_frac"] == SIMULATED_PCIE
    assert option_notes({**data, "expert_cache": 24}, None) == {}
    assert option_notes({**data, "expert_cache": 24}, preview.cpu_dense().engine) == dict.fromkeys(
        TIER | {"expert_cache"}, DENSE)
    assert option_notes({**data, "conversation_cache_slots": 0}, gpu)["conversation_cache_mib"] == (
        NO_EFFECT + "parking is off while conversation-cache-slots is 0")
    both_off = option_notes({**data, "conversation_cache_slots": 0, "conversation_cache_mib": 0}, gpu)
    assert "conversation_cache_mib" not in both_off and "conversation_cache_slots" not in both_off
    # the CPU's activations matter on a GPU only for the experts a cache leaves on the CPU
    assert option_notes({**data, "device": "cuda"}, None)["cpu_activations"] == (
        NO_EFFECT + "every product runs on the GPU (no expert cache: no expert on the CPU)")
    assert "cpu_activations" not in option_notes({**data, "device": "cuda", "expert_cache": "auto"}, None)
    assert "decodes on the GPU" in option_notes({**data, "device": "cuda"}, None)["cpu_plans"]
    assert "cpu_plans" not in option_notes({**data, "device": "cpu"}, preview.cpu_dense().engine)
    assert "cpu_activations" not in option_notes({**data, "device": "cpu"}, None)
    assert option_notes({**data, "device": "cpu", "layer_split": "2"}, None)["layer_split"] == (
        "on the CPU the stages take turns on the same cores: no speed-up")
    split = option_notes({**data, "device": "cuda", "layer_split": "2"}, None)
    assert "layer_split" not in split
    assert split["cuda_graphs"] == NO_EFFECT + "a layer split runs its stages' windows without graphs"


def test_layer_split_format_is_the_config_s_to_check() -> None:
    """RunConfig checks a split's format (the layers and GPUs are the engine's to check) with the
    engine's own parser (engine/split_spec.py); an empty split is none."""
    assert RunConfig(model="m.gguf", layer_split=" 12,24 ").layer_split == "12,24"
    assert RunConfig(model="m.gguf", layer_split="").layer_split is None
    for bad, why in (("x", "expected 'auto' or the first layer"), ("3,1", "the layers must rise"),
                     ("0", "layer 0 is out of range")):
        with pytest.raises(ValidationError, match=why):
            RunConfig(model="m.gguf", layer_split=bad)


class _Host(App):
    def __init__(self, config: RunConfig, snapshot: MetricsSnapshot):
        super().__init__()
        self.form = SettingsScreen(config, Path("strata.json"), snapshot)

    def on_mount(self) -> None:
        self.push_screen(self.form)


async def test_form_notes_follow_the_values() -> None:
    config = RunConfig(model="m.gguf", expert_cache=24, parallel=2)
    app = _Host(config, preview.cpu_moe_simulated())
    async with app.run_test(size=(120, 60)) as pilot:
        form = app.form

        def message(name: str) -> str:
            return str(form.query_one(f"#set-{name} .setting-msg").content)

        async def set_field(name: str, value: str) -> None:
            form.query_one(f"#in-{name}").value = value
            await pilot.pause()

        await pilot.pause()
        assert form.query_one("#in-expert_cache").value == "24"
        assert message("pcie_frac") == SIMULATED_PCIE and message("adapt_swaps") == ""
        await set_field("adapt_every", "0")
        assert all(message(o) == STATIC for o in ROUND) and message("adapt_every") == ""
        await set_field("expert_cache", "")  # no cache: every tier option has no effect
        assert all(message(o) == NO_CACHE for o in TIER)
        await set_field("expert_cache", "lots")
        assert message("expert_cache") == "enter auto or a whole number, or leave it empty"
        assert form.query_one("#apply").disabled
        await set_field("expert_cache", "auto")
        await set_field("adapt_every", "4")
        await set_field("conversation_cache_slots", "0")
        assert message("conversation_cache_mib") == NO_EFFECT + "parking is off while conversation-cache-slots is 0"
        await set_field("layer_split", "24,12")
        assert "the layers must rise" in message("layer_split") and form.query_one("#apply").disabled
        await set_field("layer_split", "12,24")
        assert message("layer_split") == "on the CPU the stages take turns on the same cores: no speed-up"
        assert message("batch_groups").startswith("layer split 12,24: ")  # the form's split, not the config's
        await set_field("layer_split", "")
        await set_field("cpu_activations", "int4")
        assert "'int16', 'int8' or 'float'" in message("cpu_activations") and form.query_one("#apply").disabled
        await set_field("cpu_activations", "INT8")
        assert message("cpu_activations") == ""
        await set_field("parallel", "1")
        assert message("batch_groups").startswith("parallel 1: no batch slots to group")
        assert form.candidate is not None and form.candidate.expert_cache == "auto"
        assert form.candidate.conversation_cache_slots == 0 and form.candidate.cpu_activations == "int8"
