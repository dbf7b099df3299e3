"""CPU plans (engine/cpu_plans.py, engine/kernels/plan.py): a recorded decode step replays the eager one bit
for bit, refuses what it could not replay, and reads what changes from step to step from the batch."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine.batch import Span
from engine.kernels import cpu, ops
from engine.kernels.plan import Plan, Recording
from engine.loading import open_model
from engine.runner import Runner

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"CPU kernels unavailable: {cpu.unavailable_reason()}")


@pytest.fixture(scope="module")
def demo(demo_model):
    return open_model(str(demo_model), "cpu", slots=3, context=256)[1]


def decode(runner: Runner, sessions: list[int], prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    """Each session reads its prompt, then `steps` greedy windows of one row per session: every window's logits."""
    for s in runner.sessions:
        s.tokens = []
    tokens = [int(runner.read(runner.sessions[i], p).argmax()) for i, p in zip(sessions, prompts, strict=True)]
    out = []
    for _ in range(steps):
        spans = [Span(i, len(runner.sessions[i].tokens), 1) for i in sessions]
        logits = runner.forward(spans, tokens)
        for i, t in zip(sessions, tokens, strict=True):
            runner.sessions[i].tokens.append(t)
        tokens = logits.argmax(-1).tolist()
        out.append(logits)
    return out


@pytest.mark.parametrize("sessions", [[3], [0, 2, 1]], ids=["one row", "three rows"])
def test_replayed_windows_equal_the_eager_ones_bit_for_bit(demo, sessions):
    prompts = [[2, 818, 5279, 529, 7001, 563][: 3 + i] for i in range(len(sessions))]
    eager = decode(Runner(demo, 3, exact=False, plans=False), sessions, prompts, 10)
    runner = Runner(demo, 3, exact=False)
    planned = decode(runner, sessions, prompts, 10)
    assert runner.plans is not None and runner.plans.failed is None
    assert (runner.plans.captures, runner.plans.replays) == (1, 9)  # recorded on the first window, then replayed
    for step, (a, b) in enumerate(zip(eager, planned, strict=True)):
        assert torch.equal(a, b), f"window {step} differs"


@pytest.mark.parametrize("kv", ["f32", "bf16", "q8_0"])
def test_replays_equal_eager_windows_with_every_kv_storage(demo_model, kv):
    model = open_model(str(demo_model), "cpu", slots=2, context=128, kv=kv)[1]
    prompts = [[2, 818, 5279, 529], [2, 7001]]
    eager = decode(Runner(model, 2, exact=False, plans=False), [0, 1], prompts, 6)
    runner = Runner(model, 2, exact=False)
    planned = decode(runner, [0, 1], prompts, 6)
    assert runner.plans.replays == 5
    assert all(torch.equal(a, b) for a, b in zip(eager, planned, strict=True))


def test_moe_windows_replay_with_their_expert_counts(tiny_model_q8):
    """A MoE model's windows (router and experts in C) replay bit for bit, each replay counting its routed entries
    as the eager window does (its experts' CPU time aside)."""
    model = open_model(str(tiny_model_q8), "cpu", slots=2, context=128)[1]
    prompts = [[5, 9, 11, 3], [7, 2]]
    stats = []
    logits = []
    for plans in (False, True):
        before = model.expert_stats()
        runner = Runner(model, 2, exact=False, plans=plans)
        logits.append(decode(runner, [0, 1], prompts, 6))
        stats.append(model.expert_stats() - before)
    assert runner.plans.failed is None and runner.plans.replays == 5
    assert all(torch.equal(a, b) for a, b in zip(*logits, strict=True))
    (eager, planned) = stats
    assert (planned.lookups, planned.cpu) == (eager.lookups, eager.cpu) and planned.lookups > 0


def test_an_f32_files_windows_run_eagerly(tiny_model):
    """Its float products are torch's `linear`: the recording refuses them, and the windows run as they come."""
    model = open_model(str(tiny_model), "cpu", slots=2, context=128)[1]
    eager = decode(Runner(model, 2, exact=False, plans=False), [0, 1], [[5, 9, 11], [7, 2]], 3)
    runner = Runner(model, 2, exact=False)
    assert all(torch.equal(a, b) for a, b in zip(eager, decode(runner, [0, 1], [[5, 9, 11], [7, 2]], 3), strict=True))
    assert runner.plans.failed == "torch's linear computes outside the C kernels" and runner.plans.replays == 0


def test_the_router_in_c_picks_torchs_experts():
    from engine.experts import route

    seeded = torch.Generator().manual_seed(1)
    x, router = torch.randn(7, 64, generator=seeded), torch.randn(16, 64, generator=seeded)
    for normalize in (True, False):
        weights, ids = route(x, router, 4, normalize)
        probs = torch.softmax(x @ router.T, dim=-1)
        expected, expected_ids = torch.topk(probs, 4, dim=-1)
        if normalize:
            expected = expected / expected.sum(-1, keepdim=True)
        assert torch.equal(ids, expected_ids)
        # the C dot products sum in another order: over 2,000 seeds the weights differ by up to 3.1e-6, 1.7e-5 relative
        torch.testing.assert_close(weights, expected, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="refused top_k=17"):
        ops.route(x, router, 17, True)
    before = cpu.threads()
    try:  # a chunk's rows split over threads: each row's bits as alone
        cpu.set_threads(2)
        weights, ids = ops.route(x, router, 4, True)
        for i in range(7):
            alone = ops.route(x[i:i + 1], router, 4, True)
            assert torch.equal(alone[0], weights[i:i + 1]) and torch.equal(alone[1], ids[i:i + 1])
        x[3, 5] = float("nan")
        with pytest.raises(ValueError, match="NaN"):
            ops.route(x, router, 4, True)
    finally:
        cpu.set_threads(before)


def test_a_plan_per_kernel_setting(demo):
    runner = Runner(demo, 3, exact=False)
    decode(runner, [3], [[2, 818, 5279]], 3)
    cpu.set_activations("float")
    try:
        eager = decode(Runner(demo, 3, exact=False, plans=False), [3], [[2, 818, 5279]], 3)
        planned = decode(runner, [3], [[2, 818, 5279]], 3)
    finally:
        cpu.set_activations("int16")
    assert runner.plans.captures == 2  # the int16 plan is not replayed for float activations
    assert all(torch.equal(a, b) for a, b in zip(eager, planned, strict=True))


def test_a_step_with_torch_arithmetic_is_refused_and_runs_eagerly(demo, monkeypatch):
    embed = type(demo).embed
    monkeypatch.setattr(type(demo), "embed", lambda self, tokens: embed(self, tokens) + 0.0)
    eager = decode(Runner(demo, 3, exact=False, plans=False), [3], [[2, 818]], 3)
    runner = Runner(demo, 3, exact=False)
    planned = decode(runner, [3], [[2, 818]], 3)
    assert runner.plans.failed is not None and "add" in runner.plans.failed
    assert (runner.plans.captures, runner.plans.replays) == (0, 0)
    assert all(torch.equal(a, b) for a, b in zip(eager, planned, strict=True))


def test_a_replay_reads_its_inputs_anew():
    x, w = torch.randn(3, 64), torch.randn(64)
    with Recording() as recording:
        out = ops.rms_norm(x, w, 1e-6)
    plan = Plan(recording)
    x.copy_(torch.randn(3, 64))
    plan.run()
    assert torch.equal(out, ops.rms_norm(x, w, 1e-6))


def test_a_call_a_plan_cannot_hold_is_refused():
    logits = torch.randn(2, 10)
    with Recording() as recording:
        ops.argmax(logits)
    assert recording.refused == "sd_argmax is not replayable"
    with pytest.raises(ValueError, match="cannot be planned"):
        Plan(recording)


@pytest.mark.parametrize("packed", [False, True], ids=["file layout", "packed"])
def test_a_lookup_replays_and_a_bad_row_id_is_an_error_not_a_wild_read(packed):
    blocks = torch.randint(0, 256, (16, cpu.row_bytes(Q.Q8_0, 64)), dtype=torch.uint8)
    blocks[:, 1::34] &= 0x3F
    if packed and not cpu.packs(Q.Q8_0, 16):
        pytest.skip("no packed layout on this machine")
    matrix = cpu.Matrix(Q.Q8_0, cpu.pack(Q.Q8_0, blocks, 64) if packed else blocks, 64, packed=packed)
    ids = torch.tensor([3, 0])
    with Recording() as recording:
        rows = matrix.rows(ids)
    plan = Plan(recording)
    ids[0] = 15
    plan.run()
    assert torch.equal(rows, cpu.dequantize(Q.Q8_0, blocks[[15, 0]], 64))
    ids[0] = 16
    with pytest.raises(RuntimeError, match="failed"):
        plan.run()
    with pytest.raises(IndexError):
        matrix.rows(ids)


def test_recording_a_window_does_not_import_dynamo(demo_model):
    """A recording watches torch at the Python level: a dispatch mode imports torch._dynamo (1.4 s, ~140 MiB) into
    the engine, which never loads it otherwise (tests/test_engine_start.py)."""
    code = ("import sys, torch; from engine.loading import open_model; from engine.runner import Runner; "
            "from engine.batch import Span; "
            f"m = open_model({str(demo_model)!r}, 'cpu', context=64)[1]; r = Runner(m, 0, exact=False); "
            "[r.forward([Span(0, p, 1)], [2]) for p in range(3)]; "
            "sys.exit(3 if r.plans.replays != 2 else int('torch._dynamo' in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], timeout=300).returncode == 0


def test_decode_steps_sample_the_plans_own_output_as_eager_ones(demo):
    """`Runner.decode` samples a window's logits before the next forward: a plan hands them out uncopied."""
    from engine.protocol import Sampling
    from engine.runner import Row

    tokens = []
    for plans in (False, True):
        runner = Runner(demo, 3, exact=False, plans=plans)
        for s in runner.sessions:
            s.tokens = []
        sampled = Sampling(temperature=0.8, top_k=40)
        rows = [Row(runner.sessions[i], int(runner.read(runner.sessions[i], [2, 818 + i]).argmax()),
                    sampled if i else Sampling(), seed=i) for i in range(3)]
        out = []
        for _ in range(8):
            chosen = runner.decode(rows)
            out.append(chosen)
            rows = [Row(r.session, t, r.sampling, r.seed) for r, t in zip(rows, chosen, strict=True)]
        tokens.append(out)
    assert runner.plans.replays == 7 and tokens[0] == tokens[1]
