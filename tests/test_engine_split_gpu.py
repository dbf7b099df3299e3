"""The layer split over two CUDA devices (marker `gpu`; skipped with fewer than two): what the CPU
stages of tests/test_engine_split.py cannot show, the copies between devices (the hidden state, the
batch's indices, the rope tables, a tied head's copy) and the kernels launched on the second card."""

import subprocess
import sys

import pytest
import torch

from engine.batch import Span
from engine.check import Driver, bgen, collect
from engine.loading import open_model
from engine.memory import memory_split
from engine.runner import Runner
from engine.scenarios import cases, sample_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]


def _logits(model) -> list[torch.Tensor]:
    runner = Runner(model, 2, exact=False)
    ids = list(range(5, 25))
    out = [runner.forward([Span(0, 0, 16)], ids[:16]), runner.forward([Span(0, 16, 4)], ids[16:]),
           runner.forward([Span(1, 0, 12)], ids[4:16]), runner.forward([Span(0, 20, 1), Span(1, 12, 1)], [7, 8])]
    return [t.cpu() for t in out]


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_split_logits_equal_the_unsplit_models(tiny_model, dtype):
    """The same kernels on the same rows, on two cards of one kind: the same bits."""
    _, whole = open_model(str(tiny_model), "cuda", dtype, slots=2, context=256, max_chunk=16)
    _, split = open_model(str(tiny_model), "cuda", dtype, slots=2, context=256, max_chunk=16, layer_split="2")
    for a, b in zip(_logits(whole), _logits(split), strict=True):
        assert torch.equal(a, b), (a - b).abs().max()


def test_tied_head_and_two_ropes_across_cards(demo_model):
    """Gemma 3: the head tied to the embedding (a copy on the second card) and two rope tables."""
    _, whole = open_model(str(demo_model), "cuda", slots=2, context=256, max_chunk=16)
    layers = whole.hyper.layers
    _, split = open_model(str(demo_model), "cuda", slots=2, context=256, max_chunk=16, layer_split=str(layers // 2))
    assert split.output is not split.token_embd and split.w.placed["output.weight"][2] == "cuda:1"
    for a, b in zip(_logits(whole), _logits(split), strict=True):
        assert torch.equal(a, b), (a - b).abs().max()


def test_placement_on_the_cards(tiny_model):
    _, model = open_model(str(tiny_model), "cuda", slots=2, context=256, max_chunk=16, layer_split="2")
    cards = [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert [t.device for t in model.kv.k] == [cards[0], cards[0], cards[1], cards[1]]
    assert model.blk[0].attn_norm.device == cards[0] and model.blk[3].attn_norm.device == cards[1]
    assert model.output_norm.device == cards[1]
    split = memory_split(model, 2)
    assert [e["device"] for e in split] == ["cuda:0", "cuda:1"]
    assert sum(model.w.split().values()) == model.w.bytes() and set(model.w.split()) == {"cuda:0", "cuda:1"}


@pytest.fixture(scope="module")
def split_driver(tiny_model_q8):
    """Q8_0: the Triton kernels run on both cards (launched on the second under `Stage.active`)."""
    return Driver.load(str(tiny_model_q8), slots=8, device="cuda", exact=True, layer_split="2")


@pytest.mark.parametrize("case", list(cases([2, 4, 8], 16)))
def test_split_batch_equals_solo(split_driver, case):
    split_driver.reset()
    assert cases([2, 4, 8], 16)[case](split_driver, "").failures == []


def test_group_windows_run(tiny_model_q8):
    """Without exact mode the groups' rows share windows; every slot decodes."""
    driver = Driver.load(str(tiny_model_q8), slots=8, device="cuda", exact=False, layer_split="2", groups=4)
    prompts = sample_prompts(driver.model.hyper.vocab, 8, seed=3)
    slots = collect(driver.run([bgen(i, p, 12) for i, p in enumerate(prompts)])).slots
    assert sorted(slots) == list(range(8)) and all(1 <= len(tokens) <= 12 for tokens in slots.values())


def test_serve_process_on_two_cards(tiny_model):
    proc = subprocess.run([sys.executable, "-m", "engine", "--serve", "--model", str(tiny_model), "--device", "cuda",
                           "--batch", "4", "--layer-split", "2", "--max-context", "256"],
                          input="GEN 4 1,2,3\nQUIT\n", capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    info = proc.stdout.splitlines()[0].split()
    assert "layer_split=0-1@cuda:0,2-3@cuda:1" in info and "batch_groups=2" in info
    assert any(line.startswith("T ") for line in proc.stdout.splitlines())
    assert any(line.startswith("DONE ") for line in proc.stdout.splitlines())
