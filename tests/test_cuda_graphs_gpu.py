"""Decode windows replayed from CUDA graphs (marker `gpu`): the eager windows' logits bit for bit, the same
expert counts, through both attention paths, with the GPU expert tier adapting between windows; and that
tier with windows queued ahead."""

import pytest
import torch

from engine import bench
from engine.batch import Span
from engine.kernels.triton_attention import CHUNK
from engine.layers import attend_bucket
from engine.loading import open_model
from engine.models.base import Model
from engine.protocol import Sampling
from engine.runner import Row, Runner
from engine.tier import AdaptPolicy, install_tier
from engine.tier.tier import Tier
from strata_desk.testmodel import write_test_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

WINDOWS = 12


@pytest.fixture(scope="module", params=["q4_k_m", "bf16"])
def path(request, tmp_path_factory):
    return str(write_test_model(tmp_path_factory.mktemp("q30") / f"q30-{request.param}.gguf",
                                preset="qwen3-30b-a3b", layers=2, dtype=request.param, router_skew=1.0))


def prompts(rows: int, vocab: int) -> list[list[int]]:
    """Prompts whose decode crosses a chunk boundary of the attention kernel in the first row (its eighth
    chunk begins), beside short rows."""
    lengths = [8 * CHUNK - WINDOWS // 2] + [7 + 5 * r for r in range(1, rows)]
    return [[(r * 131 + i * 7919) % (vocab - 1) + 1 for i in range(n)] for r, n in enumerate(lengths)]


def windows(runner: Runner, rows: int, feed: list[list[int]] | None = None, tier=None) -> list[torch.Tensor]:
    """Each slot reads its prompt, then `WINDOWS` decode windows of all the slots; each window's logits.
    `feed`: the tokens each window feeds (else each row's argmax), so that two runs see the same inputs;
    `tier`: told of each window (its rounds run between windows)."""
    model = runner.model
    lengths = []
    for s, ids in zip(runner.sessions, prompts(rows, model.hyper.vocab), strict=False):
        runner.forward([Span(s.index, 0, len(ids))], ids)
        lengths.append(len(ids))
    tokens = [1] * rows
    out = []
    with torch.inference_mode():
        for w in range(WINDOWS):
            if feed is not None:
                tokens = feed[w]
            spans = [Span(r, lengths[r] + w, 1) for r in range(rows)]
            before = tier.window_start() if tier is not None else None
            logits = runner.forward(spans, tokens)
            if tier is not None:
                tier.window_done(before, tier.counted())
            out.append(logits)
            tokens = logits.argmax(-1).tolist()
    return out


def fed(logits: list[torch.Tensor], rows: int) -> list[list[int]]:
    return [[1] * rows] + [w.argmax(-1).tolist() for w in logits[:-1]]


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_replayed_windows_give_the_eager_bits(path, rows):
    _, model = open_model(path, "cuda", None, 8, 2048, max_chunk=512)
    eager_runner = Runner(model, 8, exact=False, graphs=False)
    before = model.expert_stats()
    eager = windows(eager_runner, rows)
    eager_counts = model.expert_stats() - before
    runner = Runner(model, 8, exact=False)
    before = model.expert_stats()
    replayed = windows(runner, rows, fed(eager, rows))
    assert model.expert_stats() - before == eager_counts
    assert runner.graphs is not None and runner.graphs.failed is None
    lengths = [len(p) for p in prompts(rows, model.hyper.vocab)]
    shapes = {attend_bucket([Span(r, n + w, 1) for r, n in enumerate(lengths)]) for w in range(WINDOWS)}
    assert runner.graphs.captures == len(shapes) == 1  # the fused attention kernel: one shape at any length
    assert runner.graphs.replays == WINDOWS - len(shapes)  # each shape's first window eager, then replays
    for w, (a, b) in enumerate(zip(eager, replayed, strict=True)):
        assert torch.equal(a, b), f"window {w}: {(a - b).abs().max()}"


def tiered(path: str, **runner_options: bool) -> tuple[Model, Tier, Runner]:
    """The model on CUDA with half its experts in VRAM, every miss over PCIe, a round every 2 windows; a
    runner of 8 slots."""
    _, model = open_model(path, "cuda", None, 8, 2048, max_chunk=512, host_experts=True)
    h = model.hyper
    tier = install_tier(model, h.layers * h.experts // 2, AdaptPolicy(every=2, min_count=0), pcie_frac=1.0)
    return model, tier, Runner(model, 8, exact=False, **runner_options)


def test_the_expert_tier_adapts_between_replays(path):
    """Half the experts in VRAM, misses read in place over PCIe, a round every 2 windows: the slots change
    under the captured windows, whose logits and counts still match eager windows'."""
    if "bf16" in path:
        pytest.skip("the GPU tier's slots hold blocks the kernels read: the Q4_K_M mix")
    results = []
    for graphs in (False, True):
        model, tier, runner = tiered(path, graphs=graphs)
        feed = None if not results else fed(results[0][0], 8)
        logits = windows(runner, 8, feed, tier)
        results.append((logits, model.expert_stats(), tier.swaps))
        if graphs:
            assert runner.graphs.replays > 0 and runner.graphs.failed is None
    (eager, eager_stats, eager_swaps), (replayed, stats, swaps) = results
    assert swaps == eager_swaps > 0
    assert stats == eager_stats and stats.pcie > 0
    for w, (a, b) in enumerate(zip(eager, replayed, strict=True)):
        assert torch.equal(a, b), f"window {w}: {(a - b).abs().max()}"


def test_windows_queued_ahead_with_the_expert_tier(path):
    """Half the experts in VRAM, every miss read over PCIe (no layer syncs the host), a round every 2
    windows: bench-engine's loop queues each window on the last one's tokens and gives the tokens and
    the rounds it gives without (a round planned after a window then lands behind the one queued ahead)."""
    if "bf16" in path:
        pytest.skip("the GPU tier's slots hold blocks the kernels read: the Q4_K_M mix")
    results = []
    for ahead in (False, True):
        model, tier, runner = tiered(path, ahead=ahead)
        rows = [Row(runner.slot(i), int(runner.read(runner.slot(i), p).argmax()), Sampling(), 0)
                for i, p in enumerate(prompts(8, model.hyper.vocab))]
        rows = bench.decode_steps(runner, rows, WINDOWS)
        assert runner.queued_ahead == (WINDOWS - 1 if ahead else 0)
        assert tier.windows == WINDOWS and tier.rounds == WINDOWS // 2
        results.append(([s.tokens for s in runner.sessions], [r.token for r in rows], tier.swaps))
    assert results[1] == results[0] and results[0][2] > 0
