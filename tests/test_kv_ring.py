"""Sliding-window layers keep a ring of `window + max_chunk` positions: long prompts that wrap the
ring still match the reference, batched decode over rings matches one row at a time, and a
session is only continued from where its rings still hold the window."""

import pytest
import torch
from reference import reference_logits

from engine import kv_blocks, layers
from engine.batch import Span
from engine.kv import KVCache
from engine.loading import open_model
from engine.runner import Runner
from engine.tokenizer import Tokenizer

TEXT = ("The river runs past the old mill, through the meadow and under the stone bridge where the "
        "children of the village gather every summer evening to tell stories. ")


@pytest.fixture(scope="module")
def demo_ring(demo_model):
    g, model = open_model(str(demo_model), "cpu", slots=2, context=1024, max_chunk=64)
    return demo_model, model


def test_ring_is_smaller_than_the_context(demo_ring):
    _, model = demo_ring
    assert sorted(set(model.kv.lengths)) == [512 + 64, 1024]
    full = KVCache.bytes_per_session([None] * len(model.kv.lengths), 1, 1024, 256, 64, torch.float16)
    assert model.kv.session_bytes() < 0.65 * full


def test_long_prompt_past_the_ring_matches_reference(demo_ring):
    path, model = demo_ring
    ids = Tokenizer.from_gguf(path).encode(TEXT * 24)[:700]
    runner = Runner(model, 2, exact=False)
    logits = runner.read(runner.solo, ids)
    tokens, rows = [], []
    for _ in range(4):
        rows.append(logits)
        tokens.append(int(logits.argmax()))
        logits = runner.forward([Span(runner.solo.index, len(runner.solo.tokens), 1)], tokens[-1:])[0]
        runner.solo.tokens.append(tokens[-1])
    ref = reference_logits(path, ids + tokens)[len(ids) - 1 : len(ids) + 3]
    err = (torch.stack(rows) - ref).abs().max().item()
    assert err < 3e-2, err
    assert ref.argmax(-1).tolist() == tokens


def test_batched_decode_over_rings_matches_single_rows(demo_ring):
    path, model = demo_ring
    ids = Tokenizer.from_gguf(path).encode(TEXT * 24)
    runner = Runner(model, 2, exact=False)
    firsts = []
    for slot, n in ((0, 610), (1, 650)):
        firsts.append(int(runner.read(runner.slot(slot), ids[:n]).argmax()))
    spans = [Span(s, len(runner.slot(s).tokens), 1) for s in (0, 1)]
    batch = runner.forward(spans, firsts)
    single = torch.cat([runner.forward([spans[s]], firsts[s : s + 1]) for s in (0, 1)])  # the same rows again
    assert torch.allclose(batch, single, atol=2e-3, rtol=1e-3), (batch - single).abs().max()


def test_padded_decode_attention_over_rings_matches_per_row():
    """The one-call decode attention (used on CUDA) against the per-row path, past the ring's wrap."""
    from engine.batch import BatchBuilder
    from engine.layers import _attend_rows, attend

    torch.manual_seed(0)
    ring, window, heads, kv_heads, dim = 40, 32, 4, 2, 16
    k_cache, v_cache = torch.randn(2, kv_heads, ring, dim), torch.randn(2, kv_heads, ring, dim)
    q, k, v = torch.randn(2, heads, dim), torch.randn(2, kv_heads, dim), torch.randn(2, kv_heads, dim)
    spans = [Span(0, 57, 1), Span(1, 90, 1)]
    rows = BatchBuilder(torch.device("cpu"), 2, 2).build(spans, [0, 0])
    together = _attend_rows(q, k, v, k_cache.clone(), v_cache.clone(), rows, 0.25, window)
    for i, span in enumerate(spans):
        one = BatchBuilder(torch.device("cpu"), 1, 1).build([span], [0])
        alone = attend(q[i : i + 1], k[i : i + 1], v[i : i + 1], k_cache, v_cache, one, 0.25, window)
        assert torch.allclose(together[i], alone[0], atol=1e-5), (together[i] - alone[0]).abs().max()


def test_usable_prefix_needs_the_window_in_the_ring():
    kv = KVCache([512, None], 1, 1, 4096, 8, 64, torch.float16, torch.device("cpu"))
    assert kv.usable_prefix(held=500, n=300) == 300  # nothing overwritten yet
    assert kv.usable_prefix(held=2000, n=1990) == 1990  # continuing near the end
    assert kv.usable_prefix(held=2000, n=1000) == 0  # the ring no longer holds 488..999
    full = KVCache([None], 1, 1, 4096, 8, 64, torch.float16, torch.device("cpu"))
    assert full.usable_prefix(held=2000, n=1000) == 1000


@pytest.mark.parametrize("dtype", [torch.bfloat16, kv_blocks.DTYPE])
def test_saved_bytes_are_what_a_save_takes(dtype):
    """What parking checks room with (`saved_bytes`) against the copy `save` makes: before and after a ring wraps."""
    kv = KVCache((None, 4, None), 3, 2, 64, 32, 16, dtype, torch.device("cpu"))
    for n in (1, 5, 30, 64):
        k, v = kv.save(1, n, pin=False)
        assert kv.saved_bytes(n) == sum(t.numel() * t.element_size() for t in k + v)


@pytest.mark.parametrize(("start", "lo", "rows", "window"), [(0, 0, 300, None), (100, 0, 200, None),
                                                               (700, 0, 300, None), (0, 0, 300, 128),
                                                               (700, 573, 200, 128)])
def test_prompt_attention_in_row_blocks_matches_one_masked_call(start, lo, rows, window):
    """A CPU prompt chunk's attention runs PROMPT_BLOCK rows a call (LATER_PROMPT_BLOCK after as many keys) over
    only the keys they see (a chunk from its session's start, ones continuing a session, a sliding window's): one
    masked call's values."""
    from engine import layers

    gen = torch.Generator().manual_seed(start)
    keys = start + rows - lo
    q, k, v = (torch.randn(1, 4, n, 32, generator=gen) for n in (rows, keys, keys))
    q_pos, k_pos = torch.arange(start, start + rows)[:, None], torch.arange(lo, start + rows)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= q_pos - k_pos < window
    whole = layers._sdpa(q, k, v, mask[None, None], 0.2)
    blocked = layers._blocked_sdpa(q, k, v, mask, 0.2, start - lo, window)
    assert torch.allclose(blocked, whole, atol=1e-6, rtol=0)


@pytest.mark.skipif(not layers.GQA_IN_SDPA, reason="torch before 2.5: no enable_gqa")
@pytest.mark.parametrize(("start", "rows", "window"), [(0, 300, None), (700, 300, None), (700, 200, 128)])
def test_a_cpu_chunk_shares_its_kv_heads_with_the_same_bits(start, rows, window):
    """A CPU chunk's attention reads each KV head for the query heads that share it (`enable_gqa`) instead of a
    copy repeated per query head: bit for bit the repeated keys' values, in row blocks and in one call."""
    gen = torch.Generator().manual_seed(rows)
    lo = 0 if window is None else start - window + 1
    keys = start + rows - lo
    q, k, v = (torch.randn(1, h, n, 64, generator=gen) for h, n in ((8, rows), (2, keys), (2, keys)))
    q_pos, k_pos = torch.arange(start, start + rows)[:, None], torch.arange(lo, start + rows)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= q_pos - k_pos < window
    repeated = k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1)
    assert torch.equal(layers._blocked_sdpa(q, k, v, mask, 0.2, start - lo, window, gqa=True),
                       layers._blocked_sdpa(q, *repeated, mask, 0.2, start - lo, window))
    assert torch.equal(layers._sdpa(q, k, v, mask[None, None], 0.2, gqa=True),
                       layers._sdpa(q, *repeated, mask[None, None], 0.2))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
@pytest.mark.parametrize(("rows", "keys"), [(64, 64), (48, 300)])
def test_causal_prompt_attention_matches_the_masked_call(device, rows, keys):
    """A CUDA prompt chunk without a window attends through `_causal_sdpa` (the mask aligned to the last
    key, KV heads shared by their query heads: neither in memory): the values of the masked call over
    repeated keys, for a chunk from its session's start and one continuing it."""
    from engine import layers

    gen = torch.Generator().manual_seed(rows)
    q, k, v = (torch.randn(1, h, n, 64, generator=gen).to(device, torch.bfloat16)
               for h, n in ((8, rows), (2, keys), (2, keys)))
    q_pos, k_pos = torch.arange(keys - rows, keys)[:, None], torch.arange(keys)[None, :]
    masked = layers._sdpa(q, k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1),
                          (k_pos <= q_pos).to(device)[None, None], 0.125)
    causal = layers._causal_sdpa(q, k, v, 0.125)
    assert torch.allclose(causal.float(), masked.float(), atol=2e-2, rtol=0)
