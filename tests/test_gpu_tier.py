"""The GPU expert tier's layer (engine/tier/gpu_experts.py, gpu_slots.py) at small shapes: in Triton's
interpreter on the CPU (CI, the "VRAM" slots then in host memory too), compiled on a GPU, where the
host stacks are pinned and the kernel reads them over PCIe. Cached experts, misses read in place
(`far`) and misses on the CPU, each counted; kernel-computed pairs bit for bit the resident kernel's."""

import pytest
import torch
from gguf import GGMLQuantizationType as Q

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytest.importorskip("triton")

from engine.experts import ExpertStats, ResidentExperts  # noqa: E402
from engine.experts_blocks import BlockExperts  # noqa: E402
from engine.kernels import cpu as cpu_kernels  # noqa: E402
from engine.kernels import triton_moe as tm  # noqa: E402
from engine.kernels.gpu import FLOAT_BLOCKS  # noqa: E402
from engine.kernels.triton_blocks import random_blocks  # noqa: E402
from engine.linear_gpu import GpuBlockLinear  # noqa: E402
from engine.tier.gpu_experts import GpuTieredExperts  # noqa: E402
from engine.tier.gpu_slots import GpuLayerSlots, Staging  # noqa: E402
from engine.weights import BlockLinear, DenseLinear, LinearStack  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),
              pytest.mark.skipif(not cpu_kernels.available(), reason="the CPU kernels need a C compiler")]

E, H, FF = 6, 256, 256
TILES = tm.Tiles(matvec_rows=256, matvec_k=256, gemm_m=8, gemm_n=256, gemm_k=256) if DEVICE == "cpu" else None
DECODE_IDS = [[1, 3], [3, 0], [4, 1]]
PROMPT_IDS = [[r % E, (r + 2) % E] for r in range(18)]  # more rows than a decode window: a prompt chunk


def stacks(seed: int, types: tuple[Q, Q, Q] = (Q.Q4_K, Q.Q4_K, Q.Q6_K)) -> tuple[list[LinearStack], list[LinearStack]]:
    """gate, up and down (Q4_K, Q4_K, Q6_K unless `types` says) in host memory as the store keeps them for
    the tier, and the same blocks on the device as the resident kernel reads them."""
    host, device = [], []
    for i, (qtype, n, k) in enumerate(zip(types, (FF, FF, H), (H, H, FF), strict=True)):
        blocks = random_blocks(qtype, E * n, k, torch.Generator().manual_seed(seed + i)).view(E, n, -1)
        pinned = blocks.pin_memory() if DEVICE == "cuda" else blocks
        host.append(LinearStack([BlockLinear(qtype, pinned[e], k) for e in range(E)], None, blocks.numel(), pinned, qtype))
        on = blocks.to(DEVICE)
        # the resident kernel reads the stack's blocks; its experts' matrices only give their shapes
        experts = [GpuBlockLinear(qtype, on[e], k, torch.device(DEVICE)) if qtype not in FLOAT_BLOCKS else
                   DenseLinear(on[e].view(torch.float16)) for e in range(E)]
        device.append(LinearStack(experts, None, blocks.numel(), on, qtype))
    return host, device


@pytest.fixture(scope="module")
def layer():
    host, device = stacks(21)
    resident = BlockExperts(*device, torch.device(DEVICE), TILES)
    return host, resident


def inputs(rows: list[list[int]], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(len(rows), H, generator=gen) / 16).to(DEVICE, torch.float32)
    weights = torch.rand(len(rows), 2, generator=gen).to(DEVICE)
    return x, weights, torch.tensor(rows, device=DEVICE)


def tiered(host: list[LinearStack], cached: list[int], pcie_frac: float, staged: int = 0) -> GpuTieredExperts:
    """`staged`: the staging's entries (0: none, the kernel reads misses in place)."""
    slots = GpuLayerSlots(*host, len(cached), torch.device(DEVICE), TILES)
    for slot, expert in enumerate(cached):
        slots.load(slot, expert)
    return GpuTieredExperts(slots, pcie_frac, staging=Staging([slots], staged) if staged else None)


@pytest.mark.parametrize(("rows", "staged", "pcie_frac"), [
    (DECODE_IDS, 0, 1.0),  # every miss over PCIe, no host sync: read in place
    (DECODE_IDS, E, 1.0),  # the same, staged by the GPU (`triton_moe.stage_far`) in the order of their ids
    ([[0, 4], [5, 1]], 4, 1.0),  # as many entries as the window's pairs: three misses, entries 0-2
    (DECODE_IDS, 2, 0.99),  # a share: the routing read back, the far misses staged by DMA
    (PROMPT_IDS, 0, 1.0),
    (PROMPT_IDS, 2, 1.0)],  # four misses through two entries: two passes
    ids=["decode-in-place", "decode-gpu-staged", "decode-gpu-staged-compact", "decode-staged", "prompt-in-place",
         "prompt-staged-in-passes"])
def test_cached_and_far_experts_give_the_resident_kernels_bits(layer, rows, staged, pcie_frac):
    host, resident = layer
    x, weights, ids = inputs(rows, 1)
    tier = tiered(host, [3, 1], pcie_frac=pcie_frac, staged=staged)
    got = tier(x, weights, ids)
    assert torch.equal(got, resident(x, weights, ids))
    s = tier.stats()
    cached = sum(e in (3, 1) for row in rows for e in row)
    assert (s.lookups, s.vram, s.pcie, s.cpu) == (len(rows) * 2, cached, len(rows) * 2 - cached, 0)


def test_a_window_staged_by_the_gpu_needs_an_entry_for_each_pair(layer):
    host, _ = layer
    x, weights, ids = inputs(DECODE_IDS, 1)  # 6 pairs
    with pytest.raises(ValueError, match="an entry for each of the window's pairs"):
        tiered(host, [3, 1], pcie_frac=1.0, staged=2)(x, weights, ids)


@pytest.mark.parametrize("staged", [0, E], ids=["in-place", "gpu-staged"])
def test_float16_stacks_are_tiered_too(staged):
    """An F16 file's experts (kept as 16-bit values in host memory): cached and far pairs give the resident
    kernel's bits."""
    host, device = stacks(31, (Q.F16, Q.F16, Q.F16))
    resident = BlockExperts(*device, torch.device(DEVICE), TILES)
    x, weights, ids = inputs(DECODE_IDS, 3)
    tier = tiered(host, [3, 1], pcie_frac=1.0, staged=staged)
    assert torch.equal(tier(x, weights, ids), resident(x, weights, ids))


def test_misses_on_the_cpu_are_patched_in(layer):
    host, resident = layer
    x, weights, ids = inputs(DECODE_IDS, 2)
    tier = tiered(host, [3], pcie_frac=0.0)
    got = tier(x, weights, ids)
    want = ResidentExperts(*host, torch.device("cpu"))(x.cpu(), weights.cpu(), ids.cpu())
    assert torch.allclose(got.cpu(), want, rtol=1e-3, atol=1e-3 * want.abs().max().item()), (got.cpu() - want).abs().max()
    s = tier.stats()
    assert (s.lookups, s.vram, s.pcie, s.cpu) == (6, 2, 0, 4) and s.cpu_us > 0
    assert tier.routed.tolist() == [1, 2, 0, 2, 1, 0]


def test_a_share_of_misses_over_pcie_most_routed_first(layer):
    host, _ = layer
    tier = tiered(host, [], pcie_frac=0.5)
    counts = torch.tensor([1, 2, 0, 2, 1, 0])
    assert tier.split_misses([0, 1, 3, 4], counts, rows=3) == ([1, 3], [0, 4])
    assert tier.split_misses([0, 1, 3, 4], counts, rows=17) == ([0, 1, 3, 4], [])  # a chunk streams its misses
    tier.streams = False
    assert tier.split_misses([0, 1], counts, rows=17) == ([1], [0])


def test_swaps_change_what_the_cache_serves(layer):
    host, resident = layer
    x, weights, ids = inputs(DECODE_IDS, 3)
    tier = tiered(host, [0, 2], pcie_frac=1.0)
    assert torch.equal(tier(x, weights, ids), resident(x, weights, ids))
    assert tier.stats().vram == 1  # expert 0 once
    tier.slots.load(1, 1)  # expert 2 out, expert 1 in: the in-place table is stale and read again
    assert tier.slots.expert_at == [0, 1] and tier.slots.slot_of.tolist() == [0, 1, -1, -1, -1, -1]
    assert torch.equal(tier(x, weights, ids), resident(x, weights, ids))
    assert tier.stats().vram == 1 + 3  # then expert 1 twice, expert 0 once
    assert tier.routed.tolist() == [2, 4, 0, 4, 2, 0]  # counted on the device
    with pytest.raises(ValueError, match="already cached"):
        tier.slots.load(0, 1)


def test_async_rounds_publish_after_their_copies(layer):
    """`--adapt-async 1` on the GPU tier (`Copier`): the evicted slot is a miss at once, the new expert is
    served only once its copy (on the copy stream, on CUDA) has passed, and then bit for bit."""
    from engine.tier.copier import Copier
    from engine.tier.policy import Swap

    host, resident = layer
    x, weights, ids = inputs(DECODE_IDS, 3)
    tier = tiered(host, [0, 2], pcie_frac=1.0)
    tier(x, weights, ids)  # a window queued on the compute stream before the round
    copier = Copier([tier.slots])
    copier.start([Swap(0, 1, 1, 1.0)])  # expert 2 out of slot 1, expert 1 in
    assert tier.slots.slot_of.tolist() == [0, -1, -1, -1, -1, -1] and copier.busy
    assert torch.equal(tier(x, weights, ids), resident(x, weights, ids))  # expert 1 read in place meanwhile
    assert copier.finish() == 1 and not copier.busy
    assert tier.slots.slot_of.tolist() == [0, 1, -1, -1, -1, -1]
    before = tier.stats().vram
    assert torch.equal(tier(x, weights, ids), resident(x, weights, ids))
    assert tier.stats().vram - before == 3  # expert 1 twice and expert 0 from their slots


def test_slots_need_host_blocks(layer):
    _, device = stacks(5)
    if DEVICE == "cpu":
        pytest.skip("on the CPU the device's stacks are host stacks")
    with pytest.raises(ValueError, match="host memory"):
        GpuLayerSlots(*device, 2, torch.device(DEVICE), TILES)


def test_the_tier_reads_every_layers_counts_at_once(layer):
    """Layers sharing a device's `DeviceCounts` (as `install_tier` builds them): the tier's counts and
    figures, read in one operation per device, are the layers' own, in place and synced calls alike;
    layers that do not hold their device's rows in order are read one by one."""
    from engine.tier import FIXED, AdaptPolicy
    from engine.tier.gpu_experts import DeviceCounts
    from engine.tier.tier import Tier

    host, _ = layer
    counts = DeviceCounts(2, E, torch.device(DEVICE))
    layers = []
    for index, (cached, pcie_frac) in enumerate([([3, 1], 1.0), ([0], 0.0)]):  # in place; read back
        slots = GpuLayerSlots(*host, len(cached), torch.device(DEVICE), TILES)
        for slot, expert in enumerate(cached):
            slots.load(slot, expert)
        layers.append(GpuTieredExperts(slots, pcie_frac, counts=counts, index=index))
    for seed, layer_ in enumerate(layers):
        layer_(*inputs(DECODE_IDS, seed))
    tier = Tier(layers, AdaptPolicy(every=FIXED), "gpu")
    assert tier._groups == [counts]
    by_layer = sum((layer_.stats() for layer_ in layers), ExpertStats())
    assert tier.stats() == by_layer and (by_layer.vram, by_layer.pcie, by_layer.cpu) == (5, 2, 5)
    assert tier.profile("m").counts == [layer_.routed.tolist() for layer_ in layers]
    before = tier.window_start()
    layers[0](*inputs(DECODE_IDS, 5))
    served = tier.window_done(before, tier.counted())
    assert tier.counts[0].tolist() == [1, 2, 0, 2, 1, 0] and tier.counts[1].sum() == 0
    assert served == tier.stats() - by_layer and served.lookups == 6 and served.pcie == 2  # counted in place
    assert Tier(layers[::-1], AdaptPolicy(every=FIXED), "gpu")._groups is None  # out of order: one by one


@pytest.mark.skipif(DEVICE == "cpu", reason="times CUDA launches")
def test_the_miss_cost_is_timed_on_a_seeded_layer(layer):
    """`--pcie-frac -1` on slots seeded full but for a few experts: the row it times routes only those
    (8 at most), so the counts it leaves behind are none, and both costs are measured."""
    from engine.tier.gpu_experts import measure_pcie_frac

    host, _ = layer
    tier = tiered(host, [0, 1, 2, 3], pcie_frac=0.0)
    times = measure_pcie_frac(tier)
    assert times.pcie_us is not None and times.pcie_us > 0 and times.cpu_us > 0
    assert "2 missed experts" in times.text and tier.routed.sum() == 0 and tier.stats().lookups == 0
    with pytest.raises(ValueError, match="uncached experts"):
        measure_pcie_frac(tiered(host, list(range(E)), pcie_frac=0.0))


def borrowing(host: list[LinearStack], cached_sets: list[list[int]]) -> list[GpuTieredExperts]:
    """Layers whose slots share one `SlotArena` and its `Lender`, as `install_tier` builds them."""
    from engine.tier.loan import Lender, SlotArena

    shapes = [shape for cached in cached_sets for shape in GpuLayerSlots.buffer_shapes(host, len(cached))]
    arena = SlotArena(shapes, torch.device(DEVICE))
    slot_sets = [GpuLayerSlots(*host, len(cached), torch.device(DEVICE), TILES, buffers=tuple(arena.buffers[3 * i:3 * i + 3]))
                 for i, cached in enumerate(cached_sets)]
    for slots, cached in zip(slot_sets, cached_sets, strict=True):
        for slot, expert in enumerate(cached):
            slots.load(slot, expert)
    lender = Lender(arena, slot_sets)
    return [GpuTieredExperts(s, 1.0, staging=Staging(slot_sets, E), lender=lender) for s in slot_sets]


def test_prompt_chunks_borrow_cache_slots_and_give_them_back(layer):
    """A prompt chunk's MoE buffers in the arena's tail (the last layer's down slots): those slots are evicted
    first (a round's copies in flight land before), the chunk's pairs through every layer give the resident
    kernel's bits, and before the next decode window the evicted experts are copied back and served from
    their slots again."""
    from engine.tier import FIXED, AdaptPolicy
    from engine.tier.policy import Swap
    from engine.tier.sizing import outputs_bytes
    from engine.tier.tier import Tier

    host, resident = layer
    layers = borrowing(host, [[3, 1], [0, 2]])
    tier = Tier(layers, AdaptPolicy(every=FIXED), "gpu", asynchronous=True)
    lender = layers[0].lender
    assert tier.lenders == [lender]
    tier.copier.start([Swap(1, 0, 4, 1.0)])  # expert 0 out of the last layer's slot 0, expert 4 in
    x, weights, ids = inputs(PROMPT_IDS, 4)
    want = resident(x, weights, ids)
    for layer_ in layers:  # one chunk through both layers: the first takes the loan, the second reuses it
        assert torch.equal(layer_(x, weights, ids), want)
    assert not tier.copier.busy and lender.loans == 1
    assert lender.lent >= outputs_bytes(len(PROMPT_IDS) * 2, FF, H, x.dtype)
    assert layers[0].slots.slot_of.tolist() == [-1, 1, -1, 0, -1, -1]
    assert layers[1].slots.slot_of.tolist() == [-1] * E  # both slots overlap the loan: their experts streamed
    assert lender.outputs(10**6, FF, H, x) is None  # more than the arena: the caller allocates
    tier.window_start()
    assert layers[1].slots.slot_of.tolist() == [-1, -1, 1, -1, 0, -1] and lender.lent == 0
    for layer_, cached in zip(layers, ([3, 1], [4, 2]), strict=True):
        for slot, expert in enumerate(cached):
            for p in range(3):
                assert torch.equal(layer_.slots.buffers[p][slot].cpu(), host[p].blocks[expert].cpu())
    x, weights, ids = inputs(DECODE_IDS, 5)
    before = layers[1].stats().vram
    assert torch.equal(layers[1](x, weights, ids), resident(x, weights, ids))
    assert layers[1].stats().vram - before == 1  # expert 4, from its slot again


@pytest.mark.skipif(DEVICE == "cpu", reason="pinned memory is a CUDA matter")
def test_experts_left_in_pageable_memory_are_copied_by_the_host(layer):
    """Experts left in the file's memory map (`--mmap-experts`: pageable host memory) are never read by the GPU
    in place: no window replays without the host, the misses are staged by host copies, with the resident
    kernel's bits."""
    host, resident = layer
    pageable = [LinearStack(s.experts, None, s.nbytes, s.blocks.clone(), s.qtype) for s in host]
    assert not pageable[0].blocks.is_pinned()
    slots = GpuLayerSlots(*pageable, 2, torch.device(DEVICE), TILES)
    for slot, expert in enumerate([3, 1]):
        slots.load(slot, expert)
    with pytest.raises(ValueError, match="need staging"):
        GpuTieredExperts(slots, 1.0)
    tier = GpuTieredExperts(slots, 1.0, staging=Staging([slots], E))
    assert not tier.pinned and not tier.replayable(3)
    for rows in (DECODE_IDS, PROMPT_IDS):
        x, weights, ids = inputs(rows, 6)
        assert torch.equal(tier(x, weights, ids), resident(x, weights, ids))
