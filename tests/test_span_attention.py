"""Several sessions' prompt rows attended in one call (engine/span_attention.py): the index of rows and keys by
session, and on CUDA the call against each span attended alone."""

from __future__ import annotations

import pytest
import torch

from engine import kv_blocks, layers, span_attention
from engine.batch import Batch, Span, span_index

gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_the_span_index_lists_each_rows_session_and_each_spans_keys():
    index = span_index([Span(2, 0, 3), Span(0, 5, 2), Span(1, 1, 1)], torch.device("cpu"))
    assert index.row_sessions.tolist() == [2, 2, 2, 0, 0, 1]
    assert index.key_sessions.tolist() == [2] * 3 + [0] * 7 + [1] * 2
    assert index.key_positions.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 0, 1]
    assert index.cum_rows.tolist() == [0, 3, 5, 6]
    assert index.cum_keys.tolist() == [0, 3, 10, 12]
    assert (index.max_rows, index.max_keys) == (3, 7)
    assert {t.dtype for t in (index.row_sessions, index.key_positions, index.cum_keys)} == {torch.int32}


def _batch(spans: list[Span], device: str) -> Batch:
    positions = [p for s in spans for p in range(s.start, s.end)]
    ends = torch.tensor([s.length for s in spans]).cumsum(0) - 1
    return Batch(spans, torch.zeros(len(positions), dtype=torch.int64, device=device),
                 torch.tensor(positions, device=device), ends.to(device),
                 torch.tensor([s.session for s in spans], device=device))


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, kv_blocks.DTYPE])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=gpu)])
def test_spans_attended_in_one_call_match_each_span_alone(device, cache_dtype, monkeypatch):
    """Spans from their session's start and after a prefix, of 1-130 rows, GQA heads of 128: the outputs within
    rounding of the per-span path's, and the caches the same bits."""
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, sessions, length = 8, 2, 128, 5, 512
    spans = [Span(3, 0, 130), Span(0, 40, 17), Span(4, 200, 1), Span(1, 7, 64)]
    rows = _batch(spans, device)
    n = sum(s.length for s in spans)
    q, k, v = (torch.randn(n, h, dim, generator=gen).to(device, torch.bfloat16) for h in (heads, kv_heads, kv_heads))
    row = kv_blocks.row_bytes(dim) if cache_dtype == kv_blocks.DTYPE else dim
    prefix = torch.randn(2, sessions, kv_heads, length, dim, generator=gen).to(device, torch.bfloat16)
    caches = [kv_blocks.store(p, cache_dtype) for p in prefix]
    assert caches[0].shape == (sessions, kv_heads, length, row)
    alone_caches = [c.clone() for c in caches]

    assert span_attention.usable(q, caches[0], rows, None)
    together = layers.attend(q, k, v, *caches, rows, 0.088)
    monkeypatch.setattr(span_attention, "usable", lambda *a: False)
    alone = layers.attend(q, k, v, *alone_caches, rows, 0.088)

    assert together.shape == alone.shape == (n, heads * dim)
    assert torch.allclose(together.float(), alone.float(), atol=2e-2, rtol=0), (together - alone).abs().max()
    assert all(torch.equal(a, b) for a, b in zip(caches, alone_caches, strict=True))
