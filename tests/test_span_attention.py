"""Several sessions' prompt rows attended in one call (engine/span_attention.py): the index of rows and keys by
session; what the call hands torch's flash kernel, its failures and its bound (on the CPU, the kernel faked); on CUDA
the call against each span attended alone."""

from __future__ import annotations

import pytest
import torch

from engine import kv_blocks, layers, span_attention
from engine.batch import Batch, BatchBuilder, Span, index_spans

gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_the_span_index_lists_each_rows_session_and_each_spans_keys():
    index = index_spans([Span(2, 0, 3), Span(0, 5, 2), Span(1, 1, 1)], torch.device("cpu"))
    assert index.row_sessions.tolist() == [2, 2, 2, 0, 0, 1]
    assert index.key_sessions.tolist() == [2] * 3 + [0] * 7 + [1] * 2
    assert index.key_positions.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 0, 1]
    assert index.cum_rows.tolist() == [0, 3, 5, 6]
    assert index.cum_keys.tolist() == [0, 3, 10, 12]
    assert (index.max_rows, index.max_keys) == (3, 7)
    assert {t.dtype for t in (index.row_sessions, index.key_sessions, index.key_positions)} == {torch.int64}
    assert {t.dtype for t in (index.cum_rows, index.cum_keys)} == {torch.int32}


def _batch(spans: list[Span], device: str) -> Batch:
    n = sum(s.length for s in spans)
    return BatchBuilder(torch.device(device), n, len(spans)).build(spans, [0] * n)


SPANS = [Span(3, 0, 130), Span(0, 40, 17), Span(4, 100, 40), Span(1, 7, 64), Span(2, 20, 1)]  # 252 rows, 419 keys


def _inputs(device: str, cache_dtype: torch.dtype, spans: list[Span] = SPANS):
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, sessions, length = 8, 2, 128, 5, 512
    n = sum(s.length for s in spans)
    q, k, v = (torch.randn(n, h, dim, generator=gen).to(device, torch.bfloat16) for h in (heads, kv_heads, kv_heads))
    prefix = torch.randn(2, sessions, kv_heads, length, dim, generator=gen).to(device, torch.bfloat16)
    return q, k, v, [kv_blocks.store(p, cache_dtype) for p in prefix], _batch(spans, device)


class FlashCalls(list):
    """The faked flash call's arguments, one dict a call; `raises`: what the next calls raise instead."""

    raises: Exception | None = None


@pytest.fixture
def fake_flash(monkeypatch) -> FlashCalls:
    """torch's flash call replaced on the CPU: records its arguments, returns q + 1 (or raises `calls.raises`)."""
    calls = FlashCalls()

    def flash(q, keys, values, cum_rows, cum_keys, max_rows, max_keys, dropout, causal, debug, *, scale):
        calls.append(dict(q=q, keys=keys, values=values, cum_rows=cum_rows.tolist(), cum_keys=cum_keys.tolist(),
                          max_rows=max_rows, max_keys=max_keys, causal=causal, scale=scale))
        if calls.raises is not None:
            raise calls.raises
        return q + 1, None, None, None, None

    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", flash)
    monkeypatch.setattr(span_attention, "_failed", set())
    return calls


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, kv_blocks.DTYPE])
def test_the_call_stores_the_rows_and_hands_flash_each_spans_keys(cache_dtype, fake_flash):
    """The caches as the per-span path leaves them, bit for bit; flash given each span's keys (its session's positions
    up to its last row, as the cache holds them) by cumulative lengths, the mask aligned to each span's last key."""
    q, k, v, caches, rows = _inputs("cpu", cache_dtype)
    alone = [c.clone() for c in caches]
    out = span_attention.attend(q, k, v, *caches, rows, 0.088)
    layers.attend(q, k, v, *alone, rows, 0.088)  # on the CPU: each span alone
    assert all(torch.equal(a, b) for a, b in zip(caches, alone, strict=True))
    (call,) = fake_flash
    spans_keys = [kv_blocks.load(caches[0][s.session, :, : s.end], torch.bfloat16).transpose(0, 1) for s in SPANS]
    assert torch.equal(call["keys"], torch.cat(spans_keys))
    assert call["cum_rows"] == [0, 130, 147, 187, 251, 252] and call["cum_keys"] == [0, 130, 187, 327, 398, 419]
    assert (call["max_rows"], call["max_keys"], call["causal"], call["scale"]) == (130, 140, True, 0.088)
    assert torch.equal(out, (q + 1).reshape(252, -1))


def test_a_failed_flash_call_sends_the_device_to_the_per_span_path(fake_flash, capsys):
    fake_flash.raises = RuntimeError("no kernel image")
    q, k, v, caches, rows = _inputs("cpu", torch.bfloat16)
    assert span_attention.attend(q, k, v, *caches, rows, 0.088) is None
    assert span_attention._failed == {q.device}
    assert not span_attention.usable(q, rows, None)
    assert "each span attends alone from now on" in capsys.readouterr().err


def test_running_out_of_memory_in_the_call_is_raised(fake_flash):
    fake_flash.raises = torch.cuda.OutOfMemoryError("out of memory")
    q, k, v, caches, rows = _inputs("cpu", torch.bfloat16)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        span_attention.attend(q, k, v, *caches, rows, 0.088)
    assert not span_attention._failed


def test_windows_long_histories_and_float32_take_the_per_span_path():
    q, _, _, _, rows = _inputs("cpu", torch.bfloat16, [Span(0, 300, 10), Span(1, 0, 10)])  # 320 keys for 20 rows
    assert not span_attention.usable(q, rows, None)
    q, _, _, _, rows = _inputs("cpu", torch.bfloat16)
    assert not span_attention.usable(q, rows, 256)
    assert not span_attention.usable(q.float(), rows, None)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, kv_blocks.DTYPE])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=gpu)])
def test_spans_attended_in_one_call_match_each_span_alone(device, cache_dtype, monkeypatch):
    """Spans from their session's start and after a prefix, of 1-130 rows, GQA heads of 128: the outputs within
    rounding of the per-span path's, and the caches the same bits."""
    q, k, v, caches, rows = _inputs(device, cache_dtype)
    if not span_attention._flash_runs(q.device):
        pytest.skip("torch's flash kernel does not run here")
    alone_caches = [c.clone() for c in caches]
    assert span_attention.usable(q, rows, None)
    together = layers.attend(q, k, v, *caches, rows, 0.088)
    monkeypatch.setattr(span_attention, "usable", lambda *a: False)
    alone = layers.attend(q, k, v, *alone_caches, rows, 0.088)

    assert together.shape == alone.shape == (q.shape[0], q.shape[1] * q.shape[2])
    assert torch.allclose(together.float(), alone.float(), atol=2e-2, rtol=0), (together - alone).abs().max()
    assert all(torch.equal(a, b) for a, b in zip(caches, alone_caches, strict=True))
