"""`copy_spans` (engine/kernels/triton_spans.py) in Triton's interpreter on the CPU (CI), compiled where there is a GPU
(between device and pinned host memory): spans of any alignment and length copied in one launch, byte for byte,
the word the call's addresses and sizes allow; and `KVCache.save`/`load`/`copy` through it: a park and restore, a
session copied into another (a ring layer too, bf16 and Q8_0 rows), the bits of torch's copies, one launch each."""

import os

import pytest
import torch

from engine import kv_blocks
from engine.kv import KVCache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = DEVICE == "cpu"
PIN = not INTERPRETED  # host memory pinned, as a CUDA park's

pytest.importorskip("triton")
if INTERPRETED and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the kernel runs on CUDA or in Triton's interpreter (TRITON_INTERPRET=1)", allow_module_level=True)

from engine.kernels import triton_spans as ts  # noqa: E402

SPAN_DEVICE = KVCache._span_device


def random_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes on the host (NaN patterns compare too)."""
    return t.view(torch.uint8).cpu()


def done() -> None:
    if not INTERPRETED:
        torch.cuda.synchronize()


def copied(cuts: list[tuple[int, int, int]], dtype: torch.dtype, to_host: bool, size: int = 20000) -> None:
    """Copy `cuts` (source offset, destination offset, values) of a random tensor into a zeroed one in one launch,
    device to host (`to_host`) or host to device, and check every byte of the destination."""
    values = random_bytes(size * dtype.itemsize, seed=len(cuts)).view(dtype)
    src = values.to(DEVICE) if to_host else values.pin_memory() if PIN else values
    dst = torch.zeros(size, dtype=dtype, pin_memory=PIN) if to_host else torch.zeros(size, dtype=dtype, device=DEVICE)
    es = dtype.itemsize
    ts.copy_spans([(src.data_ptr() + a * es, dst.data_ptr() + b * es, n * es) for a, b, n in cuts], torch.device(DEVICE))
    done()
    expected = torch.zeros(size, dtype=dtype)
    for a, b, n in cuts:
        expected[b : b + n] = values[a : a + n]
    assert torch.equal(bits(dst), bits(expected))


def test_the_word_is_the_largest_that_divides_every_address_and_size():
    assert ts.word_bytes([(64, 128, 4096)]) == 8
    assert ts.word_bytes([(64, 128, 4096), (64, 132, 8)]) == 4
    assert ts.word_bytes([(64, 128, 6)]) == 2
    assert ts.word_bytes([(64, 129, 8)]) == 1
    assert ts.word_bytes([(0, 0, 0)]) == 8


@pytest.mark.parametrize("to_host", [True, False], ids=["to_host", "from_host"])
@pytest.mark.parametrize(("dtype", "cuts", "word"), [
    (torch.uint8, [(3, 5, 1), (10, 100, 17), (1001, 2003, 4097), (9000, 15001, 3333)], 1),  # odd: bytes
    (torch.bfloat16, [(1, 3, 5), (10, 20, 2051), (4000, 9001, 1)], 2),
    (torch.float32, [(1, 3, 5), (10, 20, 2051), (4000, 9001, 1)], 4),
    (torch.float32, [(2, 4, 6), (10, 20, 2050), (4000, 9000, 2)], 8),  # spans of 1 to 3 programs' words
], ids=["uint8", "bf16", "float32", "float32-pairs"])
def test_spans_are_copied_byte_for_byte(to_host, dtype, cuts, word):
    es = dtype.itemsize
    assert ts.word_bytes([(a * es, b * es, n * es) for a, b, n in cuts]) == word  # as the tensors' addresses allow
    copied(cuts, dtype, to_host)


def test_a_span_longer_than_the_grid_takes_several_chunks_a_program(monkeypatch):
    monkeypatch.setattr(ts, "MAX_CHUNKS", 2)
    copied([(0, 8, 5 * ts.BLOCK + 3), (7, 1, 9)], torch.float32, to_host=True)


def test_no_bytes_no_launch(monkeypatch):
    def unsent(*args: object) -> None:
        raise AssertionError("a table sent for nothing to copy")

    monkeypatch.setattr(ts, "to_device", unsent)
    ts.copy_spans([], torch.device(DEVICE))
    ts.copy_spans([(8, 8, 0)], torch.device(DEVICE))


def take_spans(monkeypatch: pytest.MonkeyPatch, spans: bool) -> list[int]:
    """Have `save`/`load` copy by spans (on CUDA their own choice; the interpreter's CPU caches made to) or by
    torch's copy_; the spans each launch copied, as the launches come."""
    def forced(self: KVCache, hosts: list[torch.Tensor]) -> torch.device | None:
        return torch.device("cpu") if spans else None

    monkeypatch.setattr(KVCache, "_span_device", SPAN_DEVICE if spans and not INTERPRETED else forced)
    launches, launch = [], ts.copy_spans

    def counted(spans: list[tuple[int, int, int]], device: torch.device) -> None:
        launches.append(len(spans))
        launch(spans, device)

    monkeypatch.setattr(ts, "copy_spans", counted)
    return launches


def filled(dtype: torch.dtype) -> KVCache:
    """Three sessions of random bits, the middle layer a ring of 8 + 16 positions."""
    kv = KVCache((None, 8, None), sessions=3, kv_heads=2, context=64, head_dim=64, max_chunk=16, dtype=dtype,
                 device=torch.device(DEVICE))
    for i, t in enumerate(kv.k + kv.v):
        t.copy_(random_bytes(t.numel() * t.element_size(), seed=i).view(dtype).view(t.shape))
    return kv


def park_and_restore(kv: KVCache, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Session 1's first `n` positions parked, restored whole into session 2 and its first 3 into session 0."""
    ks, vs = kv.save(1, n, pin=PIN)
    kv.load(2, ks, vs, n)
    kv.load(0, ks, vs, 3)  # fewer rows than parked: each head's rows a stride apart in the host copy
    done()
    return ks, vs


@pytest.mark.parametrize("dtype", [torch.bfloat16, kv_blocks.DTYPE], ids=["bf16", "q8_0"])
@pytest.mark.parametrize("n", [5, 40], ids=["ring-unwrapped", "ring-wrapped"])
def test_a_park_and_restore_by_spans_are_torch_copies_bits(monkeypatch, dtype, n):
    by_copies, by_spans = filled(dtype), filled(dtype)
    none = take_spans(monkeypatch, False)
    expected = park_and_restore(by_copies, n)
    assert none == []
    launches = take_spans(monkeypatch, True)
    got = park_and_restore(by_spans, n)
    spans = 2 * 3 * 2  # K and V, 3 layers, 2 KV heads: all but the last span in the launch
    assert launches == [spans - 1] * 3
    for a, b in zip(got[0] + got[1], expected[0] + expected[1], strict=True):
        assert a.shape == b.shape and torch.equal(bits(a), bits(b))
    for a, b in zip(by_spans.k + by_spans.v, by_copies.k + by_copies.v, strict=True):
        assert torch.equal(bits(a), bits(b))
    k = by_spans.k[0]
    assert torch.equal(bits(k[2, :, :n]), bits(k[1, :, :n])) and not torch.equal(bits(k[2]), bits(k[1]))


def test_production_takes_spans_on_one_cuda_device_with_a_pinned_copy():
    kv = KVCache((None,), 1, 2, 16, 32, 4, torch.float32, torch.device(DEVICE))
    ks, vs = kv.save(0, 4, pin=PIN)
    assert kv._span_device(ks + vs) == (None if INTERPRETED else kv.k[0].device)
    if not INTERPRETED:
        assert kv._span_device(ks + [v.clone() for v in vs]) is None  # two allocations
        assert kv._span_device(sum(kv.save(0, 4, pin=False), [])) is None  # not pinned


@pytest.mark.parametrize("dtype", [torch.bfloat16, kv_blocks.DTYPE], ids=["bf16", "q8_0"])
@pytest.mark.parametrize("n", [5, 40], ids=["ring-unwrapped", "ring-wrapped"])
def test_a_session_copied_into_another_by_spans_is_torch_copies_bits(monkeypatch, dtype, n):
    """`KVCache.copy` (a read taking another session's prefix) in one launch on one device: the bits of the copies a
    layer and K/V, the other sessions untouched."""
    by_copies, by_spans = filled(dtype), filled(dtype)
    by_copies.gpu, by_spans.gpu = None, torch.device(DEVICE)  # in the interpreter, CPU memory stands in for the GPU's
    launches = take_spans(monkeypatch, True)
    by_copies.copy(1, 2, n)
    assert launches == []
    by_spans.copy(1, 2, n)
    done()
    assert launches == [2 * 3 * 2]  # K and V, 3 layers, 2 KV heads
    for a, b in zip(by_spans.k + by_spans.v, by_copies.k + by_copies.v, strict=True):
        assert torch.equal(bits(a), bits(b))
    k = by_spans.k[0]
    assert torch.equal(bits(k[2, :, :n]), bits(k[1, :, :n])) and not torch.equal(bits(k[2]), bits(k[1]))
