"""The layer split and the slots' pipeline groups, with every stage on the CPU (two or three stages in
one process): the placement and group rules, the split model's logits against the unsplit model's,
batch = solo through the stages with and without group windows, the engine's INFO and its errors.

What only a GPU exercises (checked by `strata-desk check --layer-split ... --batch-groups ...` on two
GPUs): the copies between devices (`LocalHandoff`, `Batch.to`, the rope tables), `Stage.active`,
the tied head's copy on the last stage (tests/test_engine_split_gpu.py has those, for two GPUs).
"""

import functools
import io
import sys

import pytest
import torch

from engine.__main__ import main as engine_main
from engine.batch import Span
from engine.check import Driver, bgen
from engine.check import main as check_main
from engine.gguf_file import GGUFFile
from engine.loading import open_model, planned_on
from engine.loop import EngineLoop
from engine.memory import memory_split
from engine.placement import LocalHandoff, plan_groups, plan_stages
from engine.runner import Runner
from engine.scenarios import cases, sample_prompts
from engine.weights import planned_bytes

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture(autouse=True)
def one_thread():
    torch.set_num_threads(1)  # the tiny model gains nothing from threads, and loses a lot on a busy CPU


def test_plan_stages():
    assert plan_stages("", 4, CPU).describe() == "0-3@cpu"
    assert plan_stages("auto", 4, CPU).describe() == "0-3@cpu"  # the CPU: no split
    assert plan_stages("2", 4, CPU).describe() == "0-1@cpu,2-3@cpu"
    assert plan_stages(" 1,3 ", 4, CPU).describe() == "0-0@cpu,1-2@cpu,3-3@cpu"
    assert plan_stages("24", 48, CUDA, visible=2).describe() == "0-23@cuda:0,24-47@cuda:1"
    assert plan_stages("auto", 48, CUDA, visible=4).describe() == "0-11@cuda:0,12-23@cuda:1,24-35@cuda:2,36-47@cuda:3"
    assert plan_stages("auto", 3, CUDA, visible=4).describe() == "0-0@cuda:0,1-1@cuda:1,2-2@cuda:2"
    assert plan_stages("auto", 48, CUDA, visible=1).describe() == "0-47@cuda"
    p = plan_stages("1,3", 4, CPU)
    assert [p.device_of(i) for i in range(4)] == [CPU] * 4 and [p.stage_of(i).index for i in range(4)] == [0, 1, 1, 2]
    assert [p.tensor_stage(n).index for n in ("token_embd.weight", "blk.2.attn_q.weight", "output_norm.weight",
                                              "output.weight")] == [0, 1, 2, 2]


@pytest.mark.parametrize(("spec", "device", "message"), [
    ("3,1", CPU, "the layers must rise"),
    ("2,2", CPU, "the layers must rise"),
    ("4", CPU, "layer 4 is out of range (a stage starts at a layer in 1..3; the model has 4 layers)"),
    ("0", CPU, "layer 0 is out of range"),
    ("two", CPU, "expected 'auto' or the first layer of each later stage"),
    ("1,,3", CPU, "expected 'auto' or the first layer of each later stage"),
    ("1,2,3", CUDA, "4 stages need 4 CUDA devices, 2 visible"),
])
def test_bad_layer_splits(spec, device, message):
    with pytest.raises(ValueError) as err:
        plan_stages(spec, 4, device, visible=2)
    assert message in str(err.value)


def test_plan_groups():
    assert plan_groups("auto", 8, 2) == (2, None)
    assert plan_groups("auto", 6, 4) == (3, None)  # one per stage, at most what divides the slots
    assert plan_groups("auto", 8, 1) == (1, None)
    assert plan_groups("auto", 0, 2) == (1, None)
    assert plan_groups("1", 8, 2) == (1, None)
    assert plan_groups("4", 8, 1) == (4, None)
    assert plan_groups("3", 4, 2) == (2, "--batch-groups 3: 4 slots; running 2 groups of 2")
    assert plan_groups("16", 8, 2) == (8, "--batch-groups 16: 8 slots; running 8 groups of 1")
    assert plan_groups("2", 0, 2) == (1, "--batch-groups 2: no batch slots; one window")
    for bad in ("0", "-1", "two"):
        with pytest.raises(ValueError, match="expected 'auto' or a number of groups >= 1"):
            plan_groups(bad, 8, 2)


class CountingHandoff(LocalHandoff):
    """The local hand-off, counted, and handing on a copy (a later stage must not share the tensor)."""

    def __init__(self):
        self.moves: list[tuple[int, int]] = []

    def move(self, x, src, dst):
        self.moves.append((src.index, dst.index))
        return super().move(x, src, dst).clone()


def _logits(model) -> list[torch.Tensor]:
    """A prompt chunk, its continuation, a second session, then a decode window of both."""
    runner = Runner(model, 2, exact=False)
    ids = list(range(5, 25))
    return [runner.forward([Span(0, 0, 16)], ids[:16]), runner.forward([Span(0, 16, 4)], ids[16:]),
            runner.forward([Span(1, 0, 12)], ids[4:16]), runner.forward([Span(0, 20, 1), Span(1, 12, 1)], [7, 8])]


def test_split_logits_equal_the_unsplit_models(tiny_model):
    """Bit for bit: a stage runs the same kernels on the same rows; the split only changes where."""
    _, whole = open_model(str(tiny_model), "cpu", slots=2, context=256, max_chunk=16)
    expected = _logits(whole)
    for spec, stages in (("2", 2), ("1,3", 3)):
        _, split = open_model(str(tiny_model), "cpu", slots=2, context=256, max_chunk=16, layer_split=spec)
        split.handoff = CountingHandoff()
        got = _logits(split)
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True)), spec
        assert split.handoff.moves == [(k, k + 1) for k in range(stages - 1)] * 4


def test_split_placement_and_memory(tiny_model):
    g, model = open_model(str(tiny_model), "cpu", slots=2, context=256, max_chunk=16, layer_split="1,3")
    assert [(s.first, s.end) for s in model.placement.stages] == [(0, 1), (1, 3), (3, 4)]
    assert len(model.kv.k) == 4 and model.kv.session_bytes(CPU) == model.kv.session_bytes()
    assert model.w.split() == {"cpu": model.w.bytes()}
    [entry] = memory_split(model, 2)  # three stages on one device: one entry
    assert entry["device"] == "cpu" and entry["weights_mib"] == model.w.bytes() >> 20
    # the bytes each of two GPUs would hold, planned before loading, add up to the whole model's
    cuda = plan_stages("2", 4, CUDA, visible=2)
    on = [planned_on(g, cuda, d, torch.bfloat16) for d in cuda.devices()]
    assert sum(on) == planned_bytes(g, CUDA, torch.bfloat16) and min(on) > 0


def test_slots_fit_on_every_stage(tiny_model, monkeypatch):
    """Each GPU of a split holds its stage's weights and its layers' KV: the slots are what the tightest fits."""
    from engine import loading

    g = GGUFFile(str(tiny_model))
    cuda = plan_stages("1", 4, CUDA, visible=2)  # one layer on the first card, three on the second
    dtype, kv = torch.bfloat16, torch.float16
    second = cuda.stages[1]
    per_session = loading.session_bytes(g, 256, 16, kv, second.layers)
    assert 0 < per_session == 3 * loading.session_bytes(g, 256, 16, kv, cuda.stages[0].layers)
    room = planned_on(g, cuda, second.device, dtype) + loading.RESERVE + 4 * per_session  # the solo session + 3
    monkeypatch.setattr(loading, "free_bytes", lambda d: (room if d in (second.device, CUDA) else 1 << 40, 1 << 40))
    assert loading.fit_slots(8, g, 256, dtype, CUDA, 16, kv, cuda) == 3
    assert loading.fit_slots(8, g, 256, dtype, CUDA, 16, kv, plan_stages("", 4, CUDA)) < 3  # one card of that size


@pytest.fixture(scope="module")
def split_driver(tiny_model):
    return Driver.load(str(tiny_model), slots=8, exact=True, prefill=16, layer_split="2")


@pytest.mark.parametrize("case", list(cases([2, 4, 8], 12)))
def test_split_batch_equals_solo(split_driver, case):
    split_driver.groups = 1
    split_driver.reset()
    assert cases([2, 4, 8], 12)[case](split_driver, "").failures == []


@pytest.fixture(scope="module")
def grouped_driver(tiny_model_q8):
    """Without exact mode, so the groups' rows really share windows: the CPU block kernels compute
    each row on its own, which makes a window's tokens comparable with solo runs."""
    return Driver.load(str(tiny_model_q8), slots=8, exact=False, prefill=16, layer_split="1,3")


@pytest.mark.parametrize("groups", [2, 4])
@pytest.mark.parametrize("case", list(cases([2, 4, 8], 12)))
def test_grouped_batch_equals_solo(grouped_driver, case, groups):
    grouped_driver.groups = groups
    grouped_driver.reset()
    assert cases([2, 4, 8], 12)[case](grouped_driver, "").failures == []


def test_group_windows(grouped_driver):
    """Each decode window holds the rows of one group: 8 slots in 4 groups, 4 windows a step."""
    grouped_driver.groups = 4
    grouped_driver.reset()
    runner = grouped_driver.server.runner
    windows: list[list[int]] = []
    forward = runner.forward

    def recording(spans, tokens):
        if all(s.length == 1 for s in spans):
            windows.append([s.session for s in spans])
        return forward(spans, tokens)

    runner.forward = recording
    prompts = sample_prompts(grouped_driver.model.hyper.vocab, 8, seed=3)
    grouped_driver.run([bgen(i, p, 32) for i, p in enumerate(prompts)])
    assert [0, 1] in windows and [6, 7] in windows
    assert all(len({s // 2 for s in w}) == 1 for w in windows)


def _engine(argv, monkeypatch, capsys) -> tuple[int, list[str], str]:
    """`python -m engine --serve` in process, stdin at its end: (exit code, stdout lines, log)."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    replies = io.StringIO()
    rc = engine_main(["--serve", "--device", "cpu", "--max-context", "256", "--prefill", "16", *argv],
                     make_loop=functools.partial(EngineLoop, out=replies))
    out = capsys.readouterr()
    return rc, replies.getvalue().splitlines() + out.out.splitlines(), out.err


def test_engine_reports_the_split(tiny_model, monkeypatch, capsys):
    rc, lines, err = _engine(["--model", str(tiny_model), "--batch", "4", "--layer-split", "2",
                              "--trim-stage-weights"], monkeypatch, capsys)
    assert rc == 0 and lines[1] == "READY 256 stop"
    info = dict(kv.split("=", 1) for kv in lines[0].split()[1:])
    assert info["layer_split"] == "0-1@cpu,2-3@cpu" and info["batch_groups"] == "2"  # auto: one per stage
    assert len(info["stage_weights_mib"].split(",")) == 2
    assert not {"layer_split", "batch_groups"} & set(info["unsupported"].split(","))
    assert "layer split: stage 0: layers 0-1@cpu" in err and "--trim-stage-weights" in err


def test_engine_runs_the_groups_it_can(tiny_model, monkeypatch, capsys):
    rc, lines, err = _engine(["--model", str(tiny_model), "--batch", "4", "--batch-groups", "3"], monkeypatch, capsys)
    assert rc == 0 and "batch_groups=2" in lines[0].split() and "layer_split=-" in lines[0].split()
    assert "--batch-groups 3: 4 slots; running 2 groups of 2" in err


@pytest.mark.parametrize(("argv", "message"), [
    (["--layer-split", "3,1"], "the layers must rise"),
    (["--layer-split", "9"], "layer 9 is out of range"),
    (["--batch-groups", "0"], "expected 'auto' or a number of groups >= 1"),
])
def test_engine_refuses_bad_specs_before_loading(tiny_model, monkeypatch, capsys, argv, message):
    rc, lines, err = _engine(["--model", str(tiny_model), "--batch", "4", *argv], monkeypatch, capsys)
    assert rc == 1 and len(lines) == 1 and lines[0].startswith("ERR cannot load model: ") and message in lines[0]
    assert "loaded" not in err


def test_check_takes_the_split(tiny_model, capsys):
    assert check_main(["--model", str(tiny_model), "--device", "cpu", "--slots", "2", "--max-new", "4",
                       "--layer-split", "2", "--batch-groups", "auto"]) == 0
    assert "(0-1@cpu,2-3@cpu, 2 groups, exact mode, greedy)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        check_main(["--model", str(tiny_model), "--device", "cpu", "--layer-split", "4"])
    assert "layer 4 is out of range" in capsys.readouterr().err
