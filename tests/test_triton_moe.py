"""The fused MoE kernel (engine/kernels/triton_moe.py) and `BlockExperts` at small shapes: in Triton's
interpreter on the CPU (CI), compiled where there is a GPU. Every type against the float64 products of
gguf-py's values, the decode (matvec) and prompt (GEMM) paths, a pair's result bit-identical whatever the
window, the slot table, the CUDA format policy for expert stacks."""

import dataclasses
import functools

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from triton_checks import (
    assert_same_bits,
    check_gated,
    check_moe,
    check_projected,
    decode_rounding,
    per_pair,
    reference,
)

from engine.gguf_file import TensorInfo
from engine.kernels import gpu
from engine.weights import LinearStack, keeps_blocks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = DEVICE == "cpu"

pytest.importorskip("triton")

from engine import experts as experts_module  # noqa: E402
from engine import experts_blocks  # noqa: E402
from engine.experts import ResidentExperts, grouped_mm, grouped_mm_runs, resident_experts  # noqa: E402
from engine.experts_blocks import BlockExperts  # noqa: E402
from engine.kernels import triton_moe as tm  # noqa: E402
from engine.kernels.triton_blocks import ROUNDED, random_blocks  # noqa: E402
from engine.linear_gpu import GpuBlockLinear  # noqa: E402

# the sigmoid of a large negative gate overflows exp to inf in the interpreter's numpy: 1 / inf = 0, right
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

E, H, FF = 5, 256, 256  # experts, hidden, expert FFN: one K-quant super-block per row
SHAPES = ((FF, H), (FF, H), (H, FF))  # gate, up, down: [n, k]
# Interpreted: one weight-row tile per projection (the interpreter pays per program), GEMM tiles of 8
# pairs; one-row windows two programs a pair (their own tiles). Compiled: the tiles the shapes choose (a
# 256-row tile would not fit in registers).
TILES = tm.Tiles(matvec_rows=256, matvec_k=256, gemm_m=8, gemm_n=256, gemm_k=256, solo_rows=128, solo_warps=1,
                 solo_blocks=1) if INTERPRETED else None
DECODE_IDS = [[1, 3], [3, 0], [4, 1]]  # runs of two pairs (experts 1, 3) and of one; expert 2 unused
PROMPT_IDS = [[0, r % 4 + 1] for r in range(10)]  # expert 0: a full tile and a partial one
SLOTS = torch.arange(E, dtype=torch.int32, device=DEVICE)
DECODE_TYPES = (torch.bfloat16, torch.float32)
PROMPT_TYPES = (torch.float16, torch.float32)  # bf16 tiles: GPU only (the interpreter multiplies their bits)


def stacks_of(qtype: Q, seed: int, tiles: tm.Tiles | None = TILES,
              shapes: tuple[tuple[int, int], ...] = SHAPES) -> tuple[list[tm.Stack], list[torch.Tensor]]:
    """Random gate, up and down stacks of `qtype` ([n, k] each, `shapes`) and gguf-py's float32 values of them
    [E, n, k]."""
    gen = torch.Generator().manual_seed(seed)
    stacks, values = [], []
    for n, k in shapes:
        blocks = random_blocks(qtype, E * n, k, gen).to(DEVICE)
        stacks.append(tm.Stack(qtype, blocks.view(E, n, -1), k, tiles))
        values.append(reference(qtype, blocks).view(E, n, k))
    return stacks, values


@functools.cache
def case(qtype: Q) -> tuple[list[tm.Stack], list[torch.Tensor]]:
    return stacks_of(qtype, int(qtype))


def cases(dtypes: tuple[torch.dtype, torch.dtype], extra: Q) -> list:
    """Every type (the 16-bit float stacks of the GPU tier too) with the first dtype, one type with the
    second (the interpreter is slow)."""
    return [pytest.param(q, dtypes[0], id=f"{q.name}-{dtypes[0]}") for q in gpu.SUPPORTED + gpu.FLOAT_BLOCKS] + [
        pytest.param(extra, dtypes[1], id=f"{extra.name}-{dtypes[1]}")]


def random_x(m: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    # small: the random blocks' values reach ~15 (Q5_K), and float16 products overflow above 65504
    return (torch.randn(m, H, generator=torch.Generator().manual_seed(seed)) / 16).to(DEVICE, dtype)


def ids_of(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, device=DEVICE)


def run(stacks: list[tm.Stack], x: torch.Tensor, ids: torch.Tensor, prompt: bool,
        slot_of: torch.Tensor = SLOTS) -> tuple[tm.Routing, torch.Tensor, torch.Tensor]:
    routing = tm.Routing.of(ids, E, stacks[0].gemm_m if prompt else None)
    h = tm.swiglu(stacks[0], stacks[1], x, routing, slot_of)
    return routing, h, tm.project(stacks[2], h, routing, slot_of)


@pytest.mark.parametrize(("qtype", "dtype"), cases(DECODE_TYPES, Q.Q4_K))
def test_decode_matches_reference(qtype, dtype):
    stacks, values = case(qtype)
    x = random_x(len(DECODE_IDS), dtype)
    routing, h, y = run(stacks, x, ids_of(DECODE_IDS), prompt=False)
    check_moe(values, x, routing, h, y, prompt=False, **decode_rounding(stacks[0], len(DECODE_IDS)))


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0], ids=lambda t: t.name)
def test_one_row_windows_match_reference(qtype):
    """A window of one row runs with tiles of its own (`Tiles.solo_rows`)."""
    stacks, values = case(qtype)
    x = random_x(1, torch.bfloat16)
    routing, h, y = run(stacks, x, ids_of(DECODE_IDS[:1]), prompt=False)
    check_moe(values, x, routing, h, y, prompt=False, rounded=qtype in tm.ROUNDED)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0], ids=lambda t: t.name)
def test_decode_with_the_tiles_the_shapes_choose(qtype):
    """`Tiles.for_stack`'s own matvec tiles (one-warp programs of 2 or 4 weight rows), which the interpreted
    tests above replace by wide ones; two rows (a run of two pairs, a pair alone). The interpreter pays per
    program, and the tiles depend on k only: 32 weight rows a projection, the down over an h of its own
    (Q6_K took 127 s with 256 rows)."""
    rows = 32
    stacks, values = stacks_of(qtype, int(qtype), tiles=None, shapes=((rows, H), (rows, H), (rows, FF)))
    x = random_x(2, torch.bfloat16)
    routing = tm.Routing.of(ids_of(DECODE_IDS[:2]), E)
    rounding = decode_rounding(stacks[0], 2)  # Q8_0's tiles: int8
    check_gated(values[:2], x, routing, tm.swiglu(stacks[0], stacks[1], x, routing, SLOTS), False, **rounding)
    h = (torch.randn(routing.experts.numel(), FF, generator=torch.Generator().manual_seed(4)) / 16).to(DEVICE, x.dtype)
    check_projected(values[2], h, routing, tm.project(stacks[2], h, routing, SLOTS), False, **rounding)


@pytest.mark.parametrize(("qtype", "dtype"), cases(PROMPT_TYPES, Q.Q6_K))
def test_prompt_matches_reference(qtype, dtype):
    stacks, values = case(qtype)
    x = random_x(len(PROMPT_IDS), dtype)
    routing, h, y = run(stacks, x, ids_of(PROMPT_IDS), prompt=True)
    tiles = -(-10 // stacks[0].gemm_m)  # expert 0's 10 pairs: two tiles of 8 when interpreted
    assert routing.tile_expert.tolist()[:tiles + 1] == [0] * tiles + [1]
    check_moe(values, x, routing, h, y, prompt=True)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0], ids=lambda t: t.name)
def test_windows_of_rows_on_int8_match_reference(qtype):
    """`Tiles.int8_windows`: a window of 2-8 rows (runs of two pairs, pairs alone) sums x and h rounded to int8,
    within that rounding's error of the float64 products; a window of one row keeps int16 (Q8_0: float sums),
    within int16's bound."""
    stacks = [tm.Stack(s.qtype, s.blocks, s.k, dataclasses.replace(s.tiles(i < 2), int8_windows=True))
              for i, s in enumerate(case(qtype)[0])]
    values = case(qtype)[1]
    x = random_x(len(DECODE_IDS), torch.bfloat16)
    routing, h, y = run(stacks, x, ids_of(DECODE_IDS), prompt=False)
    check_moe(values, x, routing, h, y, prompt=False, rounded=True, largest=127)
    with pytest.raises(AssertionError, match="over the bound"):  # int8's error, well past int16's
        check_moe(values, x, routing, h, y, prompt=False, rounded=True)
    routing, h, y = run(stacks, x[:1], ids_of(DECODE_IDS[:1]), prompt=False)
    check_moe(values, x[:1], routing, h, y, prompt=False, rounded=True)


@pytest.mark.parametrize(("qtype", "int8"), [(Q.Q4_K, False), (Q.Q6_K, False), (Q.Q4_K, True), (Q.Q6_K, True),
                                             (Q.Q8_0, True)], ids=["Q4_K", "Q6_K", "Q4_K-int8", "Q6_K-int8", "Q8_0-int8"])
def test_decode_pairs_do_not_depend_on_the_window(qtype, int8):
    """Runs of two pairs agree in any window of 2-8 rows, as do pairs alone on their expert (one-row sums;
    a window of one row has tiles of its own); x rounded to int16 or (`Tiles.int8_windows`) int8."""
    stacks = [tm.Stack(s.qtype, s.blocks, s.k, dataclasses.replace(s.tiles(i < 2), int8_windows=int8))
              for i, s in enumerate(stacks_of(qtype, 7)[0])]
    x = random_x(3, torch.bfloat16, seed=2)
    ids = ids_of(DECODE_IDS)
    routing, _, y = run(stacks, x, ids, prompt=False)
    window = per_pair(routing, y)
    rows = [0, 2]  # expert 1's run again (rows 0 and 2), expert 3 now alone
    sub, _, y = run(stacks, x[rows], ids[rows], prompt=False)
    pairs = per_pair(sub, y)
    assert_same_bits(pairs[0, 0], window[0, 0])
    assert_same_bits(pairs[1, 1], window[2, 1])
    rows = [1, 2]  # experts 0 and 4 alone again, in another window
    other, _, y = run(stacks, x[rows], ids[rows], prompt=False)
    pairs = per_pair(other, y)
    assert_same_bits(pairs[0, 1], window[1, 1])
    assert_same_bits(pairs[1, 0], window[2, 0])


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0], ids=lambda t: t.name)
def test_decode_runs_on_the_tensor_cores(qtype):
    """`Tiles.mma_rows`: runs of 2-8 pairs as int8 products on the tensor cores, for Q4_K and Q6_K the int16 runs'
    integer sums, so their results to float rounding (Q8_0's runs otherwise sum x unrounded); a pair's bits
    whatever its run's company and order; pairs alone unchanged.
    The down with its shape's tiles (4-8 weight rows a program) over 48 rows: programs of 16 rows where every
    2-4 programs start one; the gate and up with `TILES` (interpreted: one program of all rows)."""
    stacks, values = stacks_of(qtype, 11, shapes=((FF, H), (FF, H), (48, FF)))
    int16 = [tm.Stack(s.qtype, s.blocks, s.k, t) for s, t in zip(
        stacks, (TILES or tm.Tiles.for_stack(qtype, H, True),) * 2 + (tm.Tiles.for_stack(qtype, FF, False),),
        strict=True)]
    mma = [tm.Stack(s.qtype, s.blocks, s.k, dataclasses.replace(s.tiles(True), mma_rows=16)) for s in int16]
    ids = ids_of([[1, 3], [3, 1], [1, 0], [4, 2]])  # expert 1: a run of 3, expert 3: of 2; 0, 2, 4 alone
    x = random_x(4, torch.float32, seed=3)
    routing, h, y = run(mma, x, ids, prompt=False)
    check_moe(values, x, routing, h, y, prompt=False, rounded=True)
    if qtype in ROUNDED:
        _, h16, y16 = run(int16, x, ids, prompt=False)
        torch.testing.assert_close(h, h16, rtol=1e-5, atol=1e-5 * h16.abs().max().item())
        torch.testing.assert_close(y, y16, rtol=1e-5, atol=1e-5 * y16.abs().max().item())
    window = per_pair(routing, y)
    sub = [1, 0, 3]  # experts 1 and 3 in runs of 2 (1's in another order), 4 and 2 alone again
    routing, _, y = run(mma, x[sub], ids[sub], prompt=False)
    for i, row in enumerate(sub):
        assert_same_bits(per_pair(routing, y)[i], window[row])


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_decode_runs_on_tiles(qtype):
    """`Tiles.tile_runs`: runs of 2-8 pairs on tiles of x's dtype dequantized in registers (the weights rounded as the
    prompt GEMM's, x as it is), so within that GEMM's bound; a pair's bits whatever its run's company and order; pairs
    alone keep the one-row sums, bit for bit. The down over 48 weight rows: programs of 16 where compiled (every 2-4
    programs start one; interpreted: one of all rows, `TILES`); x in f16 where interpreted (bf16 tiles: GPU only)."""
    stacks, values = stacks_of(qtype, 12, shapes=((FF, H), (FF, H), (48, FF)))
    plain = [tm.Stack(s.qtype, s.blocks, s.k, t) for s, t in zip(
        stacks, (TILES or tm.Tiles.for_stack(qtype, H, True),) * 2 + (TILES or tm.Tiles.for_stack(qtype, FF, False),),
        strict=True)]
    tiled = [tm.Stack(s.qtype, s.blocks, s.k, dataclasses.replace(s.tiles(i < 2), mma_rows=16, tile_runs=True))
             for i, s in enumerate(plain)]
    x = random_x(3, torch.float16 if INTERPRETED else torch.bfloat16, seed=4)
    ids = ids_of([[1, 3], [3, 1], [1, 3]])  # experts 1 and 3: runs of 3
    routing, h, y = run(tiled, x, ids, prompt=False)
    check_moe(values, x, routing, h, y, prompt=True)
    window = per_pair(routing, y)
    for sub in ([2, 0], [1, 2]):  # runs of 2, in other orders
        routing, _, y = run(tiled, x[sub], ids[sub], prompt=False)
        for i, row in enumerate(sub):
            assert_same_bits(per_pair(routing, y)[i], window[row])
    mixed = ids_of([[1, 3], [3, 1], [0, 4]])  # row 2's experts alone
    routing, _, y = run(tiled, x, mixed, prompt=False)
    _, _, y_plain = run(plain, x, mixed, prompt=False)
    assert_same_bits(per_pair(routing, y)[2], per_pair(routing, y_plain)[2])
    assert not tm.takes_tile_runs(tiled[0].tiles(True), tiled[0], tiled[0], torch.float32)  # float32 x: int8 runs
    with pytest.raises(ValueError, match="set mma_rows too"):
        dataclasses.replace(plain[0].tiles(True), tile_runs=True, mma_rows=0)
    with pytest.raises(ValueError, match="set tile_runs too"):
        dataclasses.replace(plain[0].tiles(True), tile_alone=True)
    # `Tiles.tile_alone`: pairs alone take the tiles too, runs of one: within the same bound, their bits whatever the
    # window; a window of one row keeps the one-row sums
    every = [tm.Stack(s.qtype, s.blocks, s.k, dataclasses.replace(s.tiles(i < 2), tile_alone=True))
             for i, s in enumerate(tiled)]
    routing, h, y = run(every, x, mixed, prompt=False)
    check_moe(values, x, routing, h, y, prompt=True)
    window = per_pair(routing, y)
    assert not torch.equal(window[2], per_pair(routing, y_plain)[2])  # another path than the one-row sums
    routing, _, y = run(every, x[[2, 0]], mixed[[2, 0]], prompt=False)
    assert_same_bits(per_pair(routing, y)[0], window[2])
    routing, _, y = run(every, x[2:], mixed[2:], prompt=False)
    _, _, y_plain = run(plain, x[2:], mixed[2:], prompt=False)
    assert_same_bits(y, y_plain)


@pytest.mark.parametrize("qtype", gpu.FLOAT_BLOCKS, ids=lambda t: t.name)
def test_float_windows_on_the_tensor_cores(qtype):
    """F16 and BF16 stacks' `Tiles.mma_rows`: every pair of a window of 2-8 rows, in a run or alone, as tf32 tiles on
    the tensor cores. x in bf16 and the weights are exact in tf32, so within the float sums' bound; a pair's bits
    whatever its window and its place in its run; a window of one row keeps the float sums, bit for bit. The down
    over 48 weight rows: programs of 16 where compiled (interpreted: of all rows, `TILES`)."""
    plain, values = stacks_of(qtype, 11, shapes=((FF, H), (FF, H), (48, FF)))
    mma = [tm.Stack(s.qtype, s.blocks, s.k, dataclasses.replace(s.tiles(i < 2), mma_rows=16))
           for i, s in enumerate(plain)]
    ids = ids_of([[1, 3], [3, 1], [1, 0], [4, 2]])  # expert 1: a run of 3, expert 3: of 2; 0, 2, 4 alone
    x = random_x(4, torch.bfloat16, seed=3)
    routing, h, y = run(mma, x, ids, prompt=False)
    check_moe(values, x, routing, h, y, prompt=False)
    window = per_pair(routing, y)
    for sub in ([1, 2], [3, 0], [2]):  # expert 1's run of 2 (row 1 first now), all alone, one row
        routing, _, y = run(mma, x[sub], ids[sub], prompt=False)
        if len(sub) > 1:
            for i, row in enumerate(sub):
                assert_same_bits(per_pair(routing, y)[i], window[row])
        else:
            _, _, y_plain = run(plain, x[sub], ids[sub], prompt=False)
            assert_same_bits(y, y_plain)


@pytest.mark.parametrize(("qtype", "mma"), [(Q.Q4_K, 16), (Q.Q8_0, 16), (Q.Q4_K, 0), (Q.Q6_K, 0)],
                         ids=["Q4_K-tensor-cores", "Q8_0-tensor-cores", "Q4_K-int16", "Q6_K-int16"])
def test_decode_runs_in_parts_of_k(qtype, mma):
    """`Tiles.run_parts`: a run's k cut into parts, on the tensor cores (`mma_rows`) or on the int16 sums
    (programs of their own, added in order after, then silu(gate) * up): one part's sums to float rounding; a
    pair's bits whatever its run's company; pairs alone, and the pairs the slot table skips, as in one part.
    k = 768: three parts of one step. Q4_K's gates and ups take one pass (`joint`), the others' two."""
    k = 768
    stacks, _ = stacks_of(qtype, 13, shapes=((32, k), (32, k), (48, k)))

    def tiled(parts: int) -> list[tm.Stack]:  # a block a step: a part of one step takes no more
        return [tm.Stack(s.qtype, s.blocks, s.k, dataclasses.replace(s.tiles(i < 2), mma_rows=mma, run_parts=parts,
                                                                     row_blocks=1))
                for i, s in enumerate(stacks)]

    def window(parts: int, rows: list[int], slot_of: torch.Tensor = SLOTS,
               out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up, down = tiled(parts)
        routing = tm.Routing.of(ids[rows], E)
        h = tm.swiglu(gate, up, x[rows], routing, slot_of, out)
        return per_pair(routing, h), per_pair(routing, tm.project(down, hs[:len(rows) * 2], routing, slot_of))

    ids = ids_of([[1, 3], [3, 1], [1, 0], [4, 2]])  # expert 1: a run of 3, expert 3: of 2; 0, 2, 4 alone
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(4, k, generator=gen) / 16).to(DEVICE)
    hs = (torch.randn(8, k, generator=gen) / 16).to(DEVICE)
    whole, parts = window(1, [0, 1, 2, 3]), window(3, [0, 1, 2, 3])
    for a, b in zip(parts, whole, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())
    assert_same_bits(parts[0][3], whole[0][3])  # row 3: experts 4 and 2, alone
    sub = [1, 0, 3]  # experts 1 and 3 in runs of 2 (1's in another order)
    h_sub, _ = window(3, sub)
    for i, row in enumerate(sub):
        assert_same_bits(h_sub[i], parts[0][row])
    slot_of = SLOTS.clone()
    slot_of[1] = tm.SKIP
    out = torch.full((8, 32), 7.0, device=DEVICE)
    h_skip, _ = window(3, [0, 1, 2, 3], slot_of, out)
    left = ids.cpu() == 1
    assert (h_skip.cpu()[left] == 7).all()
    assert_same_bits(h_skip.cpu()[~left], parts[0].cpu()[~left])
    with pytest.raises(ValueError, match="2 parts"):
        window(2, [0, 1])


@pytest.mark.parametrize(("qtype", "mma"), [(Q.Q8_0, 0), (Q.F16, 16)], ids=["Q8_0-float-sums", "F16-tf32"])
def test_runs_in_parts_are_refused_where_their_path_cannot(qtype, mma):
    """Q8_0 runs off the tensor cores take float sums over all of k, as F16 windows' tf32 tiles do: parts refused
    before anything runs."""
    stacks, _ = stacks_of(qtype, 13, shapes=((32, 768), (32, 768), (48, 768)))
    gate, up = (tm.Stack(s.qtype, s.blocks, s.k, dataclasses.replace(s.tiles(True), mma_rows=mma, run_parts=3))
                for s in stacks[:2])
    x = torch.zeros(2, 768, device=DEVICE)
    with pytest.raises(ValueError, match="cannot take 3 parts"):
        tm.swiglu(gate, up, x, tm.Routing.of(ids_of([[1, 3], [3, 1]]), E), SLOTS)


def test_joint_gate_and_up_give_the_same_bits():
    """`Tiles.joint`: Q4_K gates and ups in one pass over the blocks, the sums of two passes: in the matvec for
    runs and pairs alone (`DECODE_IDS` has both) and for a window of one row (its own tiles), in the GEMM for a
    prompt chunk."""
    stacks, _ = stacks_of(Q.Q4_K, 9)

    def with_joint(joint: bool) -> list[tm.Stack]:
        return [tm.Stack(s.qtype, s.blocks, s.k, dataclasses.replace(s.tiles(True), joint=joint)) for s in stacks[:2]]

    prompt_dtype = torch.float32 if INTERPRETED else torch.bfloat16  # the interpreter multiplies bf16 tiles' bits
    for ids, windows, dtype in ((ids_of(DECODE_IDS), (3, 1), torch.bfloat16),
                                (ids_of(PROMPT_IDS), (len(PROMPT_IDS),), prompt_dtype)):
        x = random_x(ids.shape[0], dtype, seed=5)
        for rows in windows:
            routing = tm.routing_of(ids[:rows], E, stacks[0].gemm_m)
            assert_same_bits(tm.swiglu(*with_joint(True), x[:rows], routing, SLOTS),
                             tm.swiglu(*with_joint(False), x[:rows], routing, SLOTS))


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.F16], ids=lambda t: t.name)
def test_programs_walking_pairs_give_the_same_bits(qtype):
    """`Tiles.pairs_a_program`: programs walking the window's runs (2, 4 or 8 sorted pairs a program: of
    `DECODE_IDS`' 4 runs, 1 or 2 a program, or all in one) compute what a program a pair does, for runs and pairs
    alone, the pairs the slot table skips left unwritten; F16 too (compiled, its tf32 tiles: every pair a run)."""
    stacks, _ = stacks_of(qtype, 11)
    x = random_x(3, torch.bfloat16, seed=6)
    routing = tm.Routing.of(ids_of(DECODE_IDS), E)
    slot_of = SLOTS.clone()
    slot_of[0] = tm.SKIP

    def window(walk: int) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up, down = (tm.Stack(s.qtype, s.blocks, s.k, dataclasses.replace(s.tiles(i < 2), pairs_a_program=walk))
                          for i, s in enumerate(stacks))
        h = tm.swiglu(gate, up, x, routing, slot_of, torch.full((6, FF), 7.0, device=DEVICE, dtype=x.dtype))
        return h, tm.project(down, h, routing, slot_of, torch.full((6, H), 7.0, device=DEVICE, dtype=x.dtype))

    one = window(1)
    assert (per_pair(routing, one[0])[1, 1] == 7).all()  # row 1's second choice: expert 0, skipped
    for walk in (2, 4, 8):
        for a, b in zip(window(walk), one, strict=True):
            assert_same_bits(a, b)
    with pytest.raises(ValueError, match="pairs_a_program"):
        dataclasses.replace(stacks[0].tiles(True), pairs_a_program=0)


@pytest.mark.skipif(INTERPRETED, reason="Triton's interpreter runs tl.dot as numpy's matmul, whose sums "
                    "depend on a row's place in the tile (the GPU's tensor cores do not)")
@pytest.mark.parametrize("qtype", gpu.SUPPORTED, ids=lambda t: t.name)
def test_prompt_pairs_do_not_depend_on_the_chunk(qtype):
    stacks, _ = case(qtype)
    x = random_x(len(PROMPT_IDS), torch.bfloat16, seed=3)
    ids = ids_of(PROMPT_IDS)
    routing, _, y = run(stacks, x, ids, prompt=True)
    part, _, y_part = run(stacks, x[3:8], ids[3:8], prompt=True)  # other tiles, other places in them
    assert_same_bits(per_pair(part, y_part), per_pair(routing, y)[3:8])


@pytest.mark.parametrize("prompt", [False, True], ids=["decode", "prompt"])
def test_slot_table_points_at_any_slots(prompt):
    stacks, _ = stacks_of(Q.Q8_0, 11)
    rows = PROMPT_IDS if prompt else DECODE_IDS
    x, ids = random_x(len(rows), torch.float16, seed=4), ids_of(rows)
    routing, _, y = run(stacks, x, ids, prompt)
    # a cache of fewer slots, the routed experts in another order, the others absent
    routed = sorted({e for row in rows for e in row})
    cache = list(reversed(routed))
    slot_of = torch.full((E,), -1, dtype=torch.int32)
    slot_of[cache] = torch.arange(len(cache), dtype=torch.int32)
    cached = [tm.Stack(s.qtype, s.blocks[cache].contiguous(), s.k, TILES) for s in stacks]
    again, _, y_cached = run(cached, x, ids, prompt, slot_of.to(DEVICE))
    assert_same_bits(per_pair(again, y_cached), per_pair(routing, y))


@pytest.mark.parametrize("prompt", [False, True], ids=["decode", "prompt"])
def test_slot_table_reads_far_entries_and_skips(prompt):
    """The expert tier's table: one expert from a cache slot, one read from the `far` copy, one skipped
    (computed elsewhere): the pairs computed are bit for bit the resident stacks' ones."""
    stacks, _ = stacks_of(Q.Q4_K, 12)
    rows = PROMPT_IDS if prompt else DECODE_IDS
    x, ids = random_x(len(rows), torch.float16, seed=8), ids_of(rows)
    routing, _, y = run(stacks, x, ids, prompt)
    routed = sorted({e for row in rows for e in row})
    cached, far, skipped = routed[0], routed[1:-1], routed[-1]
    slot_of = torch.full((E,), tm.SKIP, dtype=torch.int32)
    slot_of[cached] = 0
    for e in far:
        slot_of[e] = tm.far_slot(e)
    tier = [tm.Stack(s.qtype, s.blocks[[cached]].contiguous(), s.k, TILES, far=s.blocks) for s in stacks]
    again, _, y_tier = run(tier, x, ids, prompt, slot_of.to(DEVICE))
    done = (ids != skipped).cpu()
    assert_same_bits(per_pair(again, y_tier)[done], per_pair(routing, y)[done])


@pytest.mark.parametrize("prompt", [False, True], ids=["decode", "prompt"])
def test_given_outputs_keep_the_skipped_pairs(prompt):
    """`swiglu_experts(out=...)`: the pairs computed land in `out` bit for bit as in new buffers, the pairs
    the table skips keep what `out` held (so passes over one window's pairs can share their outputs)."""
    stacks, _ = stacks_of(Q.Q4_K, 12)
    rows = PROMPT_IDS if prompt else DECODE_IDS
    x, ids = random_x(len(rows), torch.float16, seed=8), ids_of(rows)
    skipped = sorted({e for row in rows for e in row})[-1]
    slot_of = SLOTS.clone()
    slot_of[skipped] = tm.SKIP
    y, _ = tm.swiglu_experts(*stacks, x, ids, slot_of)
    out = tm.Outputs(torch.full((ids.numel(), FF), 7.0, dtype=x.dtype, device=DEVICE),
                     torch.full((ids.numel(), H), 7.0, dtype=x.dtype, device=DEVICE))
    again, _ = tm.swiglu_experts(*stacks, x, ids, slot_of, out=out)
    assert again is out.y
    left = (ids == skipped).flatten().cpu()
    assert (out.y.cpu()[left] == 7).all() and (out.h.cpu()[left] == 7).all()
    assert_same_bits(out.y.cpu()[~left], y.cpu()[~left])
    with pytest.raises(ValueError, match="out must be"):
        tm.swiglu_experts(*stacks, x, ids, slot_of, out=tm.Outputs(out.h, out.y[:-1]))


def block_stack(qtype: Q, seed: int, n: int, k: int) -> tuple[LinearStack, LinearStack]:
    """A stack kept in its blocks (as the store keeps it on CUDA) and the same stack dense on the CPU."""
    blocks = random_blocks(qtype, E * n, k, torch.Generator().manual_seed(seed)).to(DEVICE)
    stack = blocks.view(E, n, -1)
    experts = [GpuBlockLinear(qtype, stack[e], k, torch.device(DEVICE)) for e in range(E)]
    dense = LinearStack.of_dense(reference(qtype, blocks).view(E, n, k).cpu())
    return LinearStack(experts, None, blocks.numel(), stack, qtype), dense


def test_block_experts_match_resident_experts():
    (gate, gate_dense), (up, up_dense) = (block_stack(Q.Q4_K, seed, FF, H) for seed in (1, 2))
    down, down_dense = block_stack(Q.Q6_K, 3, H, FF)
    fused = BlockExperts(gate, up, down, torch.device(DEVICE), TILES)
    dense = ResidentExperts(gate_dense, up_dense, down_dense, torch.device("cpu"))
    x = random_x(len(DECODE_IDS), torch.float32, seed=5)
    weights = torch.rand(len(DECODE_IDS), 2, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    ids = ids_of(DECODE_IDS)
    got, want = fused(x, weights, ids).cpu(), dense(x.cpu(), weights.cpu(), ids.cpu())
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item()), (got - want).abs().max()
    assert fused.stats().lookups == 6 and (fused.stats().vram if DEVICE == "cuda" else fused.stats().cpu) == 6
    assert isinstance(resident_experts(gate, up, down, torch.device(DEVICE)),
                      BlockExperts if DEVICE == "cuda" else ResidentExperts)


def test_prompt_chunks_from_dequantized_rows_take_the_grouped_gemms(monkeypatch):
    """A chunk of `DEQUANTIZED_ROWS` rows or more: each stack dequantized to bf16, three grouped GEMMs, the
    fused kernel's results within bf16's rounding; every pair counted as the fused kernel counts it."""
    if not grouped_mm_runs(torch.device(DEVICE)):
        pytest.skip("torch's grouped GEMM does not run here")
    (gate, _), (up, _) = (block_stack(Q.Q4_K, seed, FF, H) for seed in (1, 2))
    down, _ = block_stack(Q.Q6_K, 3, H, FF)
    experts = BlockExperts(gate, up, down, torch.device(DEVICE), TILES)
    x = random_x(len(PROMPT_IDS), torch.float32, seed=5)
    weights = torch.rand(len(PROMPT_IDS), 2, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    ids = ids_of(PROMPT_IDS)
    fused = experts(x, weights, ids)
    calls = []
    monkeypatch.setattr(experts_module, "grouped_mm", lambda *args: calls.append(1) or grouped_mm(*args))
    monkeypatch.setattr(experts_blocks, "DEQUANTIZED_ROWS", len(PROMPT_IDS))
    experts.dequantizes = True  # on the CPU too, where the engine keeps the fused kernel (the interpreter's)
    assert_same_bits(experts(x, weights, ids), fused)  # float32 x: the fused kernel (the grouped GEMMs take bf16)
    assert not calls
    got = experts(x.bfloat16(), weights, ids)
    assert len(calls) == 3 and got.dtype == torch.bfloat16
    if DEVICE == "cuda":  # run after run (exact mode reads a prompt alone so); in the interpreter a dequantized
        assert_same_bits(experts(x.bfloat16(), weights, ids), got)  # stack takes ~9 s, and the CPU's GEMMs repeat
    # bf16 weights, x, gate, up and h against the fused kernel's float32 x and sums here: ~1% apart
    assert ((got.float() - fused).norm() / fused.norm()).item() < 2e-2
    assert experts.stats().lookups == (4 if DEVICE == "cuda" else 3) * ids.numel()


def test_a_layer_of_blocks_and_dense_stacks_runs_per_expert(monkeypatch):
    """On CUDA a layer may keep some stacks in blocks and dequantize others (a type the kernels do not
    read): it runs one product per routed expert, never the grouped GEMMs over a missing dense stack."""
    monkeypatch.setattr(experts_module, "grouped_mm_runs", lambda device: True)  # the policy, on any machine
    (gate, gate_dense), (up, up_dense) = (block_stack(Q.Q8_0, seed, FF, H) for seed in (1, 2))
    down, down_dense = block_stack(Q.Q8_0, 3, H, FF)
    bf16 = [LinearStack.of_dense(s.dense.bfloat16()) for s in (gate_dense, up_dense)]
    mixed = resident_experts(*bf16, down, torch.device("cuda"))  # nothing is allocated on the device
    assert isinstance(mixed, ResidentExperts) and not mixed.grouped
    assert ResidentExperts(*bf16, LinearStack.of_dense(down_dense.dense.bfloat16()), torch.device("cuda")).grouped


def test_bad_input():
    stacks, _ = stacks_of(Q.Q8_0, 13)
    blocks = stacks[0].blocks
    with pytest.raises(ValueError, match="blocks must be"):
        tm.Stack(Q.Q8_0, blocks[0], H)
    with pytest.raises(ValueError, match="no Triton kernel"):
        tm.Stack(Q.Q5_0, blocks, H)
    x, ids = random_x(9, torch.float32), ids_of([[0, 1]] * 9)
    with pytest.raises(ValueError, match="at most"):
        run(stacks, x, ids, prompt=False)
    with pytest.raises(ValueError, match="x must be"):
        run(stacks, x.double(), ids, prompt=True)
    with pytest.raises(ValueError, match="slot_of must be"):
        run(stacks, x, ids, prompt=True, slot_of=SLOTS.long())
    with pytest.raises(ValueError, match="ids must be"):
        tm.Routing.of(ids.float(), E)
    routing = tm.Routing.of(ids, E)
    with pytest.raises(ValueError, match="one row per routed pair"):
        tm.project(stacks[2], x, routing, SLOTS)
    with pytest.raises(ValueError, match="mma_rows must be"):
        tm.Tiles(4, 256, 64, 64, 64, mma_rows=8)


def info(name: str, shape: tuple[int, ...], qtype: Q) -> TensorInfo:
    return TensorInfo(name, shape, qtype, offset=0, nbytes=0)


def test_cuda_policy_keeps_expert_blocks_the_kernel_reads():
    cuda = torch.device("cuda")
    assert keeps_blocks(info("blk.0.ffn_up_exps.weight", (8, 64, 256), Q.Q4_K), cuda)
    assert keeps_blocks(info("blk.0.ffn_down_exps.weight", (8, 256, 64), Q.Q6_K), cuda)
    assert keeps_blocks(info("blk.0.ffn_up_exps.weight", (8, 64, 256), Q.F16), cuda)  # its values, as they are
    assert keeps_blocks(info("blk.0.ffn_up_exps.weight", (8, 64, 256), Q.BF16), cuda)
    assert not keeps_blocks(info("blk.0.attn_q.weight", (64, 256), Q.F16), cuda)  # cuBLAS
    assert not keeps_blocks(info("blk.0.ffn_up_exps.weight", (8, 64, 256), Q.Q5_0), cuda)


def test_weighted_sum_is_each_rows_choices_in_order():
    """`weighted_sum` (what `experts.combine` runs on CUDA): y in flat (row, choice) order times each row's
    weights, summed in float32 in the order of choices; a row's bits the same alone."""
    gen = torch.Generator().manual_seed(12)
    y = torch.randn(3 * 4, 96, generator=gen).to(DEVICE)
    weights = torch.rand(3, 4, generator=gen).to(DEVICE)
    out = tm.weighted_sum(y, weights)
    expected = torch.zeros(3, 96, device=DEVICE)
    for i in range(4):
        expected += weights[:, i:i + 1] * y.view(3, 4, 96)[:, i]
    assert out.dtype == y.dtype and torch.equal(out, expected)
    assert torch.equal(tm.weighted_sum(y[4:8], weights[1:2]), out[1:2])
    with pytest.raises(ValueError, match="rows \\* top_k"):
        tm.weighted_sum(y[:5], weights)


def test_weighted_sum_reads_outputs_in_another_order_in_place():
    """With `at`, flat pair p's output is y's row at[p]: the sum of y gathered into flat order, bit for bit;
    `experts.combine` reads a prompt chunk's outputs sorted by expert that way (no scatter back)."""
    from engine.experts import by_expert, combine

    gen = torch.Generator().manual_seed(14)
    ids = torch.stack([torch.randperm(6, generator=gen)[:4] for _ in range(3)]).to(DEVICE)
    flat, order = by_expert(ids)
    y_flat = torch.randn(3 * 4, 96, generator=gen).to(DEVICE)
    weights = torch.rand(3, 4, generator=gen).to(DEVICE)
    y_sorted = y_flat[order]
    at = torch.argsort(order)
    assert torch.equal(tm.weighted_sum(y_sorted, weights, at=at), tm.weighted_sum(y_flat, weights))
    assert torch.equal(combine(y_sorted, weights, order), tm.weighted_sum(y_flat, weights))
    with pytest.raises(ValueError, match="at must be int64"):
        tm.weighted_sum(y_sorted, weights, at=at[:5])
    with pytest.raises(ValueError, match="patch"):
        combine(y_sorted, weights, order, patch=(at[:1], y_flat[:1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([] if INTERPRETED else [torch.bfloat16]), ids=str)
def test_weighted_sum_adds_the_residual_bit_for_bit(dtype):
    """With `residual`, the bits of `residual + weighted_sum(y, weights)` in one launch: the sum rounded to
    y's dtype first, as a layer's residual add after it rounds (the interpreter truncates to bf16 where
    torch rounds: bf16 on the GPU only)."""
    gen = torch.Generator().manual_seed(13)
    y = torch.randn(3 * 4, 96, generator=gen).to(DEVICE, dtype)
    weights = torch.rand(3, 4, generator=gen).to(DEVICE)
    residual = (torch.randn(3, 96, generator=gen) * 4).to(DEVICE, dtype)
    out = tm.weighted_sum(y, weights, residual)
    assert out.dtype == dtype and torch.equal(out, residual + tm.weighted_sum(y, weights))
    if dtype != torch.float32:  # it rounds twice, not once
        assert not torch.equal(out, (residual.float() + tm.weighted_sum(y.float(), weights)).to(dtype))
    with pytest.raises(ValueError, match="residual must be"):
        tm.weighted_sum(y, weights, residual[:2])


@pytest.mark.parametrize("normalize", [True, False])
def test_route_matches_torch(normalize):
    """`triton_moe.route` (what `experts.route` runs on CUDA): the torch router's experts in its order and
    its weights within float32 rounding; a row's bits the same alone."""
    from engine.experts import route

    gen = torch.Generator().manual_seed(13)
    x = torch.randn(5, 96, generator=gen).to(DEVICE, torch.bfloat16)
    router = torch.randn(24, 96, generator=gen).to(DEVICE)
    weights, ids = tm.route(x, router, 4, normalize)
    expect_w, expect_ids = route(x.cpu(), router.cpu(), 4, normalize)
    assert ids.dtype == torch.int64 and torch.equal(ids.cpu(), expect_ids)
    assert torch.allclose(weights.cpu(), expect_w, rtol=1e-5, atol=1e-7)
    w1, i1 = tm.route(x[3:4], router, 4, normalize)
    assert torch.equal(w1, weights[3:4]) and torch.equal(i1, ids[3:4])


def test_route_of_a_prompt_chunk_takes_tiles(monkeypatch):
    """From `ROUTER_TILE_ROWS` rows (64 here, for the interpreter's sake) the logits come in tiles: the same
    experts as torch's router and the weights within float32 rounding; compiled, a row's bits the same whatever
    the other rows of the call (the interpreter's products are numpy's, whose sums depend on a row's place in the
    tile)."""
    from engine.experts import route

    monkeypatch.setattr(tm, "ROUTER_TILE_ROWS", 64)
    gen = torch.Generator().manual_seed(15)
    rows = tm.ROUTER_TILE_ROWS + 37  # rows and experts in part tiles
    x = (torch.randn(rows, 96, generator=gen) * 0.1).to(DEVICE, torch.bfloat16)
    router = torch.randn(24, 96, generator=gen).to(DEVICE)
    weights, ids = tm.route(x, router, 4, True)
    expect_w, expect_ids = route(x.cpu(), router.cpu(), 4, True)
    assert torch.equal(ids.cpu(), expect_ids)
    assert torch.allclose(weights.cpu(), expect_w, rtol=1e-5, atol=1e-7)
    w2, i2 = tm.route(x[5:5 + tm.ROUTER_TILE_ROWS], router, 4, True)
    assert torch.equal(i2, ids[5:5 + tm.ROUTER_TILE_ROWS])
    assert torch.allclose(w2, weights[5:5 + tm.ROUTER_TILE_ROWS], rtol=1e-6, atol=0)
    assert INTERPRETED or torch.equal(w2, weights[5:5 + tm.ROUTER_TILE_ROWS])


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_decode_routing_is_a_stable_sort(rows):
    """A decode window's pairs sorted in one launch: torch's stable argsort of the flat ids, the experts in
    that order, each pair's row; experts shared by rows keep their rows in order."""
    gen = torch.Generator().manual_seed(rows)
    ids = torch.stack([torch.randperm(12, generator=gen)[:8] for _ in range(rows)]).to(DEVICE)
    for dtype in (torch.int64, torch.int32):
        routing = tm.Routing.of(ids.to(dtype), 12)
        order = torch.argsort(ids.reshape(-1).cpu(), stable=True)
        assert routing.order.dtype == torch.int64 and torch.equal(routing.order.cpu(), order)
        assert torch.equal(routing.experts.cpu(), ids.reshape(-1).cpu()[order].to(torch.int32))
        assert torch.equal(routing.src.cpu(), (order // 8).to(torch.int32))


def tiled_reference(flat: torch.Tensor, top_k: int, n_experts: int, gemm_m: int) -> tuple[torch.Tensor, ...]:
    """A prompt chunk's routing in torch: the pairs' stable sort by expert, each expert's pairs padded to whole
    tiles of `gemm_m` (-1 in the padding), each tile's expert (-1 past the last)."""
    flat = flat.cpu().long()
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    counts = torch.bincount(flat, minlength=n_experts)
    tiles = (counts + gemm_m - 1) // gemm_m
    tile_end = torch.cumsum(tiles, 0)
    bound = -(-flat.numel() // gemm_m) + min(n_experts, flat.numel())
    tile_expert = torch.searchsorted(tile_end, torch.arange(bound), right=True)
    tile_expert = torch.where(tile_expert < n_experts, tile_expert, -1)
    padded = torch.full((bound * gemm_m,), -1, dtype=torch.int64)
    position = torch.arange(flat.numel())
    padded[(tile_end - tiles)[experts] * gemm_m + position - (torch.cumsum(counts, 0) - counts)[experts]] = position
    return order, experts, order // top_k, tile_expert, padded


@pytest.mark.parametrize(("rows", "skew"), [(9, False), (64, True), (300, False), (512, True)])
def test_prompt_routing_pads_each_experts_pairs_to_tiles(rows, skew):
    """A prompt chunk's pairs sorted and padded to GEMM tiles in one launch: the torch reference's sort, tiles
    and padding, whatever the rows (not a multiple of the kernel's chunks), with experts routed to by no pair
    and, skewed, by most rows."""
    gen = torch.Generator().manual_seed(rows)
    weights = torch.arange(1, 25, dtype=torch.float64) ** (-2.0 if skew else 0.0)
    ids = torch.stack([torch.multinomial(weights, 4, generator=gen) for _ in range(rows)]).to(DEVICE)
    routing = tm.Routing.of(ids, 24, 16)
    want = tiled_reference(ids.reshape(-1), 4, 24, 16)
    got = (routing.order, routing.experts, routing.src, routing.tile_expert, routing.padded)
    assert [t.dtype for t in got] == [torch.int64] + [torch.int32] * 4
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.cpu().long(), w)
    decode = tm.Routing.of(ids, 24)  # more pairs than the one-program sort takes, no tiles
    assert decode.padded is None and torch.equal(decode.order.cpu(), want[0])
