"""The fused MoE kernel compiled on CUDA at qwen3-30b-a3b's expert shapes (marker `gpu`; skipped without a
GPU): hidden 2048, expert FFN 768, 128 experts, top-8. Every type (F16 and BF16 values too) against the
float64 products of gguf-py's values, decode windows of 1 and 8 rows and a 512-row prompt chunk, each pair's result
bit-identical whatever the window of 2-8 rows (alone on its expert or in company), the slot table; a Q4_K_M model keeps its experts' blocks on the GPU
and batch = solo."""

import pytest
import torch
from gguf import GGMLQuantizationType as Q

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():  # before the kernels are imported: elsewhere they run interpreted
    pytest.skip("needs CUDA", allow_module_level=True)

from triton_checks import assert_same_bits, check_moe, decode_rounding, per_pair  # noqa: E402

from engine.check import Driver, compare, sample_prompts  # noqa: E402
from engine.experts import ResidentExperts  # noqa: E402
from engine.experts_blocks import BlockExperts  # noqa: E402
from engine.kernels import gpu  # noqa: E402
from engine.kernels import triton_blocks as tb  # noqa: E402
from engine.kernels import triton_moe as tm  # noqa: E402
from strata_desk.testmodel import write_test_model  # noqa: E402

HIDDEN, FF, EXPERTS, TOP_K = 2048, 768, 128, 8
SHAPES = ((FF, HIDDEN), (FF, HIDDEN), (HIDDEN, FF))  # gate, up, down: [n, k]
PROMPT = 512


@pytest.fixture(scope="module", params=gpu.SUPPORTED + gpu.FLOAT_BLOCKS, ids=lambda t: t.name)
def case(request: pytest.FixtureRequest) -> tuple[list[tm.Stack], list[torch.Tensor]]:
    """Random gate, up and down stacks (tiles chosen by their shapes) and gguf-py's values of them
    (the block kernels' exact dequantization, tested against gguf-py in test_triton_gpu.py)."""
    qtype = request.param
    gen = torch.Generator().manual_seed(int(qtype))
    stacks, values = [], []
    for n, k in SHAPES:
        blocks = tb.random_blocks(qtype, EXPERTS * n, k, gen).cuda()
        stacks.append(tm.Stack(qtype, blocks.view(EXPERTS, n, -1), k))
        if qtype in gpu.FLOAT_BLOCKS:
            values.append(blocks.view(gpu.FLOAT_DTYPE[qtype]).float().view(EXPERTS, n, k))
        else:
            values.append(tb.Matrix(qtype, blocks, k).dequantize().view(EXPERTS, n, k))
    return stacks, values


def window(m: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, HIDDEN] bf16 (scaled so that float16 would not overflow either) and top-8 ids per row."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, HIDDEN, generator=gen) / 64).to("cuda", torch.bfloat16)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(m)])
    return x, ids.cuda()


def run(stacks: list[tm.Stack], x: torch.Tensor, ids: torch.Tensor, slot_of: torch.Tensor | None = None
        ) -> tuple[tm.Routing, torch.Tensor, torch.Tensor]:
    slot_of = torch.arange(EXPERTS, dtype=torch.int32, device="cuda") if slot_of is None else slot_of
    prompt = ids.shape[0] > tb.MATVEC_ROWS
    routing = tm.Routing.of(ids, EXPERTS, stacks[0].gemm_m if prompt else None)
    h = tm.swiglu(stacks[0], stacks[1], x, routing, slot_of)
    return routing, h, tm.project(stacks[2], h, routing, slot_of)


@pytest.mark.parametrize("m", [1, tb.MATVEC_ROWS, PROMPT])
def test_matches_reference(case, m):
    stacks, values = case
    x, ids = window(m, seed=m)
    routing, h, y = run(stacks, x, ids)
    prompt = m > tb.MATVEC_ROWS
    check_moe(values, x, routing, h, y, prompt=prompt, **({} if prompt else decode_rounding(stacks[0], m)))


def test_decode_pairs_do_not_depend_on_the_window(case):
    """A pair's bits depend on its row and on whether its expert's run in the window has company: pairs of
    runs of 2-8 agree in any window of 2-8 rows, as do pairs alone on their expert (a window of one row has
    tiles of its own: its pairs agree with themselves, window after window)."""
    stacks, _ = case
    x, ids = window(tb.MATVEC_ROWS, seed=2)
    ids[:, 0] = 5  # every row routes expert 5: a run of 8 pairs in one program
    routing, _, y = run(stacks, x, ids)
    together = per_pair(routing, y)[:, 0]
    for i in range(tb.MATVEC_ROWS - 1):
        two, _, y = run(stacks, x[i:i + 2], ids[i:i + 2])
        assert_same_bits(per_pair(two, y)[:, 0], together[i:i + 2])
    part, _, y = run(stacks, x[2:7], ids[2:7])
    assert_same_bits(per_pair(part, y)[:, 0], together[2:7])
    apart = torch.arange(tb.MATVEC_ROWS * TOP_K, device="cuda").view(tb.MATVEC_ROWS, TOP_K)  # no expert shared
    routing, _, y = run(stacks, x, apart)
    alone_in_window = per_pair(routing, y)
    for i in range(tb.MATVEC_ROWS - 1):
        two, _, y = run(stacks, x[i:i + 2], apart[i:i + 2])
        assert_same_bits(per_pair(two, y), alone_in_window[i:i + 2])
    for i in range(2):
        alone, _, y = run(stacks, x[i:i + 1], apart[i:i + 1])
        again, _, y2 = run(stacks, x[i:i + 1], apart[i:i + 1])
        assert_same_bits(per_pair(alone, y)[0], per_pair(again, y2)[0])


def test_prompt_pairs_do_not_depend_on_the_chunk(case):
    stacks, _ = case
    x, ids = window(PROMPT, seed=3)
    routing, _, y = run(stacks, x, ids)
    chunk = per_pair(routing, y)
    for lo, hi in ((37, 301), (500, PROMPT)):  # other tiles, other places in them, other tile counts
        part, _, y = run(stacks, x[lo:hi], ids[lo:hi])
        assert_same_bits(per_pair(part, y), chunk[lo:hi])


@pytest.mark.parametrize("m", [tb.MATVEC_ROWS, PROMPT])
def test_slot_table_points_at_any_slots(m):
    gen = torch.Generator().manual_seed(9)
    stacks = [tm.Stack(Q.Q4_K, tb.random_blocks(Q.Q4_K, EXPERTS * n, k, gen).cuda().view(EXPERTS, n, -1), k)
              for n, k in SHAPES]
    x, ids = window(m, seed=4)
    routing, _, y = run(stacks, x, ids)
    perm = torch.randperm(EXPERTS, generator=torch.Generator().manual_seed(5)).cuda()
    slot_of = torch.empty_like(perm)
    slot_of[perm] = torch.arange(EXPERTS, device="cuda")  # expert perm[s] lives in slot s
    moved = [tm.Stack(s.qtype, s.blocks[perm].contiguous(), s.k) for s in stacks]
    again, _, y_moved = run(moved, x, ids, slot_of.to(torch.int32))
    assert_same_bits(per_pair(again, y_moved), per_pair(routing, y))


@pytest.mark.parametrize("preset", ["tiny", "small", "qwen3-30b-a3b"])
def test_q4_k_m_model_batch_equals_solo(tmp_path_factory, preset):
    """Experts kept in their blocks (small, qwen3-30b-a3b), or the tiny preset's mix of dense Q5_0 gates
    and ups with Q8_0 blocks for some downs (one product per routed expert): batch = solo either way."""
    layers = 2 if preset == "qwen3-30b-a3b" else None
    path = write_test_model(tmp_path_factory.mktemp("models") / f"{preset}-q4_k_m.gguf", preset=preset,
                            layers=layers, dtype="q4_k_m", router_skew=1.0)
    driver = Driver.load(str(path), slots=8, device="cuda")
    described = driver.model.w.describe()
    if preset == "tiny":
        assert "Q8_0 blocks" in described, described
        for b in driver.model.blk:  # layers 2 and 3 keep their downs in Q8_0 blocks: no grouped GEMMs there
            assert isinstance(b.experts, ResidentExperts) and b.experts.grouped == (b.ffn_down_exps.blocks is None)
        assert [b.experts.grouped for b in driver.model.blk] == [True, True, False, False]
    else:
        assert "Q4_K blocks" in described and "Q6_K blocks" in described, described
        assert all(isinstance(b.experts, BlockExperts) for b in driver.model.blk)
    prompts = sample_prompts(driver.model.hyper.vocab, 8, seed=5)
    assert compare(driver, prompts, max_new=24) == []
