"""The fused decode attention kernel (engine/kernels/triton_attention.py) at small shapes: in Triton's
interpreter on the CPU (CI), compiled where there is a GPU. Against float64 attention over each row's own
positions (full and sliding layers, rings that wrap), GQA, and each row's bits alone = in any window."""

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytest.importorskip("triton")

from engine.kernels import triton_attention  # noqa: E402
from engine.kernels.triton_attention import BLOCK_L, CHUNK, decode_attention  # noqa: E402

SESSIONS, KV_HEADS, HEADS, D = 3, 2, 6, 32  # 3 query heads per KV head (a padded head block)
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def caches(ring: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(SESSIONS, KV_HEADS, ring, D, generator=gen) for _ in range(2))
    return k.to(DEVICE, dtype), v.to(DEVICE, dtype)


def attend(q, k_cache, v_cache, sessions, positions, scale, window=None):
    """`decode_attention` with each row's key and value the ones its cache already holds (written again)."""
    slots = positions % k_cache.shape[2]
    k, v = k_cache[sessions, :, slots].clone(), v_cache[sessions, :, slots].clone()
    return decode_attention(q, k, v, k_cache, v_cache, sessions, positions, scale, window)


def reference(q, k_cache, v_cache, sessions, positions, scale, window):
    """float64 softmax attention of each row over the positions it sees, read from ring slot p % ring."""
    ring = k_cache.shape[2]
    rep = HEADS // KV_HEADS
    out = []
    for row, (s, pos) in enumerate(zip(sessions.tolist(), positions.tolist(), strict=True)):
        lo = 0 if window is None else max(0, pos - window + 1)
        slots = torch.arange(lo, pos + 1) % ring
        keys = k_cache[s][:, slots].double().cpu().repeat_interleave(rep, dim=0)  # [Hq, L, D]
        values = v_cache[s][:, slots].double().cpu().repeat_interleave(rep, dim=0)
        qr = q[row].double().cpu()  # [Hq, D]
        weights = torch.softmax((keys @ qr[:, :, None])[..., 0] * scale, dim=-1)  # [Hq, L]
        out.append((weights[:, None, :] @ values)[:, 0].reshape(-1))
    return torch.stack(out)


CASES = {  # ring, window, (session, position) of each row
    "full": (200, None, [(0, 0), (1, 5), (2, BLOCK_L), (0, 150)]),
    "sliding ring": (96, 40, [(0, 3), (1, 39), (2, 130), (1, 95)]),
    "many chunks": (5 * CHUNK, None, [(0, 5 * CHUNK - 1), (1, 2 * CHUNK), (2, CHUNK - 1), (0, 3)]),
    "sliding, many chunks": (3 * CHUNK + 16, 2 * CHUNK + 5, [(0, 9 * CHUNK + 7), (1, 2 * CHUNK + 4), (2, 40)]),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_float64_attention(case, dtype):
    ring, window, rows = CASES[case]
    k_cache, v_cache = caches(ring, dtype)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(len(rows), HEADS, D, generator=gen).to(DEVICE, dtype)
    sessions = torch.tensor([s for s, _ in rows], device=DEVICE)
    positions = torch.tensor([p for _, p in rows], device=DEVICE)
    scale = D ** -0.5
    got = attend(q, k_cache, v_cache, sessions, positions, scale, window)
    assert got.shape == (len(rows), HEADS * D) and got.dtype == dtype
    want = reference(q, k_cache, v_cache, sessions, positions, scale, window)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.double().cpu(), want, atol=tolerance, rtol=tolerance), (got.double().cpu() - want).abs().max()


@pytest.mark.parametrize("case", list(CASES))
def test_a_row_alone_gives_its_bits_in_any_window(case):
    ring, window, rows = CASES[case]
    k_cache, v_cache = caches(ring, torch.float16, seed=2)
    q = torch.randn(len(rows), HEADS, D, generator=torch.Generator().manual_seed(3)).to(DEVICE, torch.float16)
    sessions = torch.tensor([s for s, _ in rows], device=DEVICE)
    positions = torch.tensor([p for _, p in rows], device=DEVICE)
    together = attend(q, k_cache, v_cache, sessions, positions, 0.2, window)
    for i in range(len(rows)):
        alone = attend(q[i : i + 1], k_cache, v_cache, sessions[i : i + 1], positions[i : i + 1], 0.2, window)
        assert torch.equal(alone[0], together[i])


def many_chunks() -> tuple:
    """The "many chunks" window in float16: q, the caches, sessions, positions and the window."""
    ring, window, rows = CASES["many chunks"]
    k_cache, v_cache = caches(ring, torch.float16, seed=4)
    q = torch.randn(len(rows), HEADS, D, generator=torch.Generator().manual_seed(5)).to(DEVICE, torch.float16)
    sessions = torch.tensor([s for s, _ in rows], device=DEVICE)
    positions = torch.tensor([p for _, p in rows], device=DEVICE)
    return q, k_cache, v_cache, sessions, positions, window


def test_the_merge_rounds_the_rows_it_writes():
    """A decode window's output rounded for attn_output's int16 product in the merge's launch, and split into the
    tensor cores' int8 planes: what `RoundedRows.of` returns for it, the same as rounding it apart."""
    from test_triton_kernels import assert_same_rounding

    from engine.kernels.triton_xq import RoundedRows, _made

    q, k_cache, v_cache, sessions, positions, window = many_chunks()
    RoundedRows.want(q.device, planes=True)  # as a matrix on the tensor cores says: int8 planes of 2-8 rows too
    out = attend(q, k_cache, v_cache, sessions, positions, 0.2, window)
    assert _made[out.device][0].data_ptr() == out.data_ptr()  # remembered, not rounded again by `of`
    assert RoundedRows.of(out).hi is not None
    assert_same_rounding(RoundedRows.of(out), RoundedRows.of(out.clone()))


def test_the_rows_keys_and_values_are_written_first():
    """A decode window's k and v written into ring slot position % ring of each row's session (float32
    rows into float16 caches), as `layers.attend` wrote them with indexed assignment, before the rows
    attend: the output is the one over caches that held them already."""
    k_cache, v_cache = caches(40, torch.float16, seed=6)
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    gen = torch.Generator().manual_seed(7)
    k, v = (torch.randn(3, KV_HEADS, D, generator=gen).to(DEVICE) for _ in range(2))
    q = torch.randn(3, HEADS, D, generator=gen).to(DEVICE, torch.float16)
    sessions = torch.tensor([2, 0, 1], device=DEVICE)
    positions = torch.tensor([5, 39, 87], device=DEVICE)  # the last wraps the ring of a sliding layer
    out = decode_attention(q, k, v, k_cache, v_cache, sessions, positions, 0.2, window=40)
    expect_k[sessions, :, positions % 40] = k.to(torch.float16)
    expect_v[sessions, :, positions % 40] = v.to(torch.float16)
    assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)
    assert torch.equal(out, attend(q, expect_k, expect_v, sessions, positions, 0.2, window=40))
    with pytest.raises(ValueError, match="for these caches"):
        decode_attention(q, k[:, :1], v[:, :1], k_cache, v_cache, sessions, positions, 0.2)


def test_keys_and_values_read_from_column_slices_of_one_product():
    """k and v of a window as `Model.attention` passes them (v a column slice of the joined q|k|v product, its
    rows a stride apart): written and attended the same as from contiguous copies."""
    gen = torch.Generator().manual_seed(8)
    qkv = torch.randn(3, (HEADS + 2 * KV_HEADS) * D, generator=gen).to(DEVICE, torch.float16)
    q, k, v = (part.reshape(3, -1, D) for part in qkv.split([HEADS * D, KV_HEADS * D, KV_HEADS * D], dim=1))
    sessions = torch.tensor([2, 0, 1], device=DEVICE)
    positions = torch.tensor([5, 39, 87], device=DEVICE)
    outs, caches_after = [], []
    for kk, vv in ((k, v), (k.contiguous(), v.contiguous())):
        k_cache, v_cache = caches(40, torch.float16, seed=9)
        outs.append(decode_attention(q, kk, vv, k_cache, v_cache, sessions, positions, 0.2, window=40))
        caches_after.append((k_cache, v_cache))
    assert torch.equal(outs[0], outs[1])
    assert all(torch.equal(a, b) for a, b in zip(*caches_after, strict=True))


def test_bad_shapes_are_refused():
    k_cache, v_cache = caches(16, torch.float32)
    q = torch.zeros(1, 5, D, device=DEVICE)  # 5 query heads over 2 KV heads
    one = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="query heads"):
        attend(q, k_cache, v_cache, one, one, 1.0)


def test_a_row_has_its_bits_however_its_chunks_are_spread(monkeypatch):
    """The programs a launch runs per (row, KV head) change with the window's rows: each chunk's partial
    result and the merge must not."""
    q, k_cache, v_cache, sessions, positions, window = many_chunks()
    spread = attend(q, k_cache, v_cache, sessions, positions, 0.2, window)
    monkeypatch.setattr(triton_attention, "PROGRAMS", 1)  # one program per (row, KV head) walks every chunk
    assert torch.equal(attend(q, k_cache, v_cache, sessions, positions, 0.2, window), spread)


def test_the_fused_kernel_takes_every_length():
    """On CUDA with Triton a decode step is one shape (bucket 0) at any length; the padded call's buckets
    (without Triton) follow the window's longest session."""
    from engine.batch import Span
    from engine.layers import ATTEND_BUCKET, attend_bucket

    spans = [Span(0, 5, 1), Span(1, 40_000, 1)]
    assert attend_bucket(spans) == 0
    assert attend_bucket(spans, fused=False) == -(-40_001 // ATTEND_BUCKET) * ATTEND_BUCKET
