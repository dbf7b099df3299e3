"""The C float32 ops of a CPU decode step (engine/kernels/ops.py) against their torch formulations."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from engine import kv_blocks
from engine.kernels import cpu, ops

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"CPU kernels unavailable: {cpu.unavailable_reason()}")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_rms_norm_matches_torch():
    x, w = torch.randn(5, 640, generator=gen(0)) * 3, torch.randn(640, generator=gen(1))
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), F.rms_norm(x, (640,), w, 1e-6), rtol=1e-6, atol=1e-6)
    heads = torch.randn(2, 4, 256, generator=gen(2))  # per-head norms: rows of the last dimension
    wh = torch.randn(256, generator=gen(3))
    torch.testing.assert_close(ops.rms_norm(heads, wh, 1e-6), F.rms_norm(heads, (256,), wh, 1e-6),
                               rtol=1e-6, atol=1e-6)


def rope_tables(dim: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    angles = torch.arange(context, dtype=torch.float64)[:, None] * inv[None, :]
    return angles.cos().float(), angles.sin().float()


def test_rope_matches_the_rotate_halves_formula():
    n, heads, dim = 3, 4, 64
    cos, sin = rope_tables(dim, 100)
    x, pos = torch.randn(n, heads, dim, generator=gen(4)), torch.tensor([0, 17, 99])
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]
    expected = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    assert torch.equal(ops.rope(x, pos, cos, sin, neox=True), expected)


def test_normal_rope_rotates_adjacent_pairs_as_complex_numbers():
    """llama.cpp's normal rope: pair (2i, 2i + 1) is the complex number x[2i] + i x[2i + 1] times
    e^(i * pos * theta_i), computed here in float64 complex arithmetic."""
    n, heads, dim = 3, 4, 64
    cos, sin = rope_tables(dim, 100)
    x, pos = torch.randn(n, heads, dim, generator=gen(11)), torch.tensor([0, 5, 98])
    turn = torch.polar(torch.ones_like(cos[pos], dtype=torch.float64), torch.atan2(sin[pos], cos[pos]).double())
    expected = torch.view_as_real(torch.view_as_complex(x.double().unflatten(-1, (-1, 2))) * turn[:, None, :])
    torch.testing.assert_close(ops.rope(x, pos, cos, sin, neox=False), expected.flatten(-2).float(),
                               rtol=1e-6, atol=1e-6)


def test_rope_fallback_in_torch_matches_the_kernel(monkeypatch):
    """layers.Rope's torch path (CPU tensors the C kernels do not take) and the C kernel rotate alike, both variants."""
    from engine.layers import Rope

    x, pos = torch.randn(5, 3, 64, generator=gen(12)), torch.tensor([0, 1, 2, 40, 63])
    for neox in (True, False):
        rope = Rope(64, 10000.0, 64, torch.device("cpu"), neox=neox)
        fast = rope(x, pos)
        monkeypatch.setattr(ops, "usable", lambda _x: False)
        torch.testing.assert_close(rope(x, pos), fast, rtol=1e-6, atol=1e-6)
        monkeypatch.undo()


def reference_attention(q, keys, values, positions, scale):
    """q [H, D]; keys/values [Hkv, ring, D]; positions: which ring slots, in order."""
    slots = torch.tensor([p % keys.shape[1] for p in positions])
    k = kv_blocks.load(keys[:, slots], torch.float32).double().repeat_interleave(q.shape[0] // keys.shape[0], dim=0)
    v = kv_blocks.load(values[:, slots], torch.float32).double().repeat_interleave(q.shape[0] // keys.shape[0], dim=0)
    w = torch.softmax((q.double()[:, None, :] @ k.transpose(1, 2)) * scale, dim=-1)
    return (w @ v).reshape(1, -1).float()


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16, kv_blocks.DTYPE),
                         ids=("f32", "f16", "bf16", "q8_0"))
def test_attend_row_stores_its_kv_then_matches_softmax_attention(dtype):
    """The row's key and value stored as the cache keeps them (torch's rounding; Q8_0: gguf-py's), bit for
    bit, then attention over the stored values."""
    heads, kv_heads, dim, ring = 4, 2, 64, 48
    keys = kv_blocks.store(torch.randn(kv_heads, ring, dim, generator=gen(5)), dtype)
    values = kv_blocks.store(torch.randn(kv_heads, ring, dim, generator=gen(6)), dtype)
    q = torch.randn(heads, dim, generator=gen(7))
    scale = 1 / math.sqrt(dim)
    for lo, hi in ((0, 1), (0, 48), (30, 70)):  # the last wraps around the ring
        k, v = torch.randn(kv_heads, dim, generator=gen(hi)) * 1e3, torch.randn(kv_heads, dim, generator=gen(-hi))
        expected_keys, expected_values = keys.clone(), values.clone()
        v[0, :8] = torch.tensor([0.0, 127.0, -63.5, 0.5, 1.5, -2.5, 1e-30, 3.0])  # ties at the scale 1 (127 / 127)
        expected_keys[:, (hi - 1) % ring] = kv_blocks.store(k, dtype)
        expected_values[:, (hi - 1) % ring] = kv_blocks.store(v, dtype)
        got = ops.attend_row(q, k, v, keys, values, lo, hi, scale)
        assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)  # torch's rounding
        torch.testing.assert_close(got, reference_attention(q, keys, values, range(lo, hi), scale),
                                   rtol=1e-5, atol=1e-5)


def test_attend_row_is_the_same_on_any_number_of_threads():
    keys, values = torch.randn(1, 4096, 256, generator=gen(8)), torch.randn(1, 4096, 256, generator=gen(9))
    q, k, v = torch.randn(4, 256, generator=gen(10)), keys[:, -1].clone(), values[:, -1].clone()
    before = cpu.threads()
    try:
        results = []
        for n in (1, 2):
            cpu.set_threads(n)
            results.append(ops.attend_row(q, k, v, keys, values, 0, 4096, 0.0625))
    finally:
        cpu.set_threads(before)
    assert torch.equal(results[0], results[1])


def test_rows_of_a_split_product_are_normed_and_rotated_in_place():
    """q and k as a joined product's split outputs (rows strided, each row contiguous): the same bits as from
    contiguous copies."""
    y = torch.randn(3, 4 * 64 + 2 * 64, generator=gen(12))
    q, k = (part.reshape(3, -1, 64) for part in y.split([4 * 64, 2 * 64], dim=-1))
    assert not q.is_contiguous()
    w = torch.randn(64, generator=gen(13))
    assert torch.equal(ops.rms_norm(q, w, 1e-6), ops.rms_norm(q.contiguous(), w, 1e-6))
    cos, sin = rope_tables(64, 10)
    pos = torch.tensor([1, 5, 9])
    for neox in (True, False):
        assert torch.equal(ops.rope(k, pos, cos, sin, neox), ops.rope(k.contiguous(), pos, cos, sin, neox))


@pytest.mark.parametrize("neox", (True, False))
def test_a_chunks_rows_normed_rotated_and_routed_as_each_row_alone(neox):
    """A prompt chunk's 299 rows (past `SD_SPREAD_FROM`: over the threads; the router's passes of 4 rows, the last
    short): each row's bits those of the row alone, on 1 and 2 threads."""
    x = torch.randn(299, 32, 128, generator=gen(20)) * 2
    w, pos, cos_sin = torch.randn(128, generator=gen(21)), torch.arange(299) * 3, rope_tables(128, 1000)
    router, hidden = torch.randn(128, 512, generator=gen(22)), x.reshape(-1, 512)[:299]
    alone = [(ops.rms_norm(x[i:i + 1], w, 1e-6), ops.rope(x[i:i + 1], pos[i:i + 1], *cos_sin, neox),
              ops.route(hidden[i:i + 1], router, 8, True)) for i in range(299)]
    before = cpu.threads()
    try:
        for threads in (1, 2):
            cpu.set_threads(threads)
            normed, rotated = ops.rms_norm(x, w, 1e-6), ops.rope(x, pos, *cos_sin, neox)
            weights, ids = ops.route(hidden, router, 8, True)
            for i, (n, r, (wi, ii)) in enumerate(alone):
                assert torch.equal(normed[i:i + 1], n) and torch.equal(rotated[i:i + 1], r), (threads, i)
                assert torch.equal(weights[i:i + 1], wi) and torch.equal(ids[i:i + 1], ii), (threads, i)
    finally:
        cpu.set_threads(before)


@pytest.mark.parametrize("window", (None, 5))
def test_attend_rows_is_attend_row_for_each_row(window):
    """A decode step's rows, each from its session and position in the batch's tensors, as attend_row computes
    each alone (q, k and v strided as split outputs), the new keys and values stored in their sessions."""
    sessions_n, heads, kv_heads, dim, ring = 4, 4, 2, 64, 8
    caches = [torch.randn(sessions_n, kv_heads, ring, dim, generator=gen(20 + i)) for i in range(2)]
    y = torch.randn(3, (heads + 2 * kv_heads) * dim, generator=gen(22))
    q, k, v = (p.reshape(3, -1, dim) for p in y.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1))
    sessions, positions = torch.tensor([2, 0, 3]), torch.tensor([3, 6 if window is None else 11, 0])  # 11: a ring's wrap
    expected_caches = [c.clone() for c in caches]
    expected = torch.cat([ops.attend_row(q[r], k[r], v[r], expected_caches[0][s], expected_caches[1][s],
                                         0 if window is None else max(0, p - window + 1), p + 1, 0.125)
                          for r, (s, p) in enumerate(zip(sessions.tolist(), positions.tolist(), strict=True))])
    got = ops.attend_rows(q, k, v, *caches, sessions, positions, window, 0.125)
    assert torch.equal(got, expected)
    assert all(torch.equal(a, b) for a, b in zip(caches, expected_caches, strict=True))


def test_argmax_is_the_first_largest():
    x = torch.randn(3, 262_147, generator=gen(11))
    x[1, 5], x[1, 900] = 50.0, 50.0  # a tie: the first
    x[2, -1] = 60.0  # in the scalar tail
    assert ops.argmax(x).tolist() == x.argmax(-1).tolist() == [int(x[0].argmax()), 5, 262_146]


@pytest.mark.parametrize("rows", [5, 40], ids=["window", "chunk"])
@pytest.mark.parametrize("fixture", ["tiny_model", "tiny_model_q8"])
def test_swiglu_experts_in_c_match_the_per_expert_products(fixture, rows, request):
    """A decode window's or a prompt chunk's routed experts in one C call (float32 and Q8_0 stacks): the
    values of one product per expert in torch, each row's bits the same alone as in the call, a bad
    expert id refused."""
    from engine.experts import route
    from engine.loading import open_model

    _, model = open_model(str(request.getfixturevalue(fixture)), "cpu", context=64)
    layer, h = model.blk[0], model.hyper
    experts = layer.experts
    assert experts.c_stacks is not None
    x = torch.randn(rows, h.hidden, generator=torch.Generator().manual_seed(0))
    weights, ids = route(x, layer.ffn_gate_inp, h.experts_used, normalize=True)
    window = experts(x, weights, ids)
    stacks, experts.c_stacks = experts.c_stacks, None
    try:
        per_expert = experts(x, weights, ids)
    finally:
        experts.c_stacks = stacks
    # float32 sums in other orders (a chunk's per-expert products in torch: slab GEMMs); values reach ~5
    assert torch.allclose(window, per_expert, atol=1e-5, rtol=1e-5), (window - per_expert).abs().max()
    for i in range(0, rows, 4):
        assert torch.equal(experts(x[i:i + 1], weights[i:i + 1], ids[i:i + 1]), window[i:i + 1])
    with pytest.raises(ValueError, match="refused"):
        ops.swiglu_experts(stacks, x[:1], torch.tensor([[0, h.experts]]), weights[:1])


@pytest.mark.skipif(not cpu.packs(Q.Q8_0, 16), reason="no packed Q8_0 layout on this build")
def test_swiglu_experts_with_packed_and_file_layout_stacks_mixed(tiny_model_q8):
    """Packed expert stacks (the store packs each expert's rows by 16 where the build can) give the file
    layout's values, all packed or only some (the gates and ups then in two regions), each row alike alone."""
    from engine.experts import route
    from engine.gguf_file import GGUFFile
    from engine.loading import open_model

    _, model = open_model(str(tiny_model_q8), "cpu", context=64)
    layer, h = model.blk[0], model.hyper
    packed = layer.experts.c_stacks
    assert all(qtype & cpu.PACKED_STACK for qtype, _ in packed)
    g = GGUFFile(tiny_model_q8)
    file_layout = [(int(Q.Q8_0), torch.from_numpy(g.tensor_bytes(f"blk.0.{name}.weight").copy()))
                   for name in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")]
    x = torch.randn(9, h.hidden, generator=gen(4))
    weights, ids = route(x, layer.ffn_gate_inp, h.experts_used, normalize=True)
    reference = ops.swiglu_experts(tuple(file_layout), x, ids, weights)
    for mix in ((packed[0], file_layout[1], packed[2]), (file_layout[0], packed[1], file_layout[2]), tuple(packed)):
        out = ops.swiglu_experts(mix, x, ids, weights)
        assert torch.allclose(out, reference, atol=1e-5, rtol=1e-5), (out - reference).abs().max()
        for i in (0, 8):
            assert torch.equal(ops.swiglu_experts(mix, x[i:i + 1], ids[i:i + 1], weights[i:i + 1]), out[i:i + 1])
