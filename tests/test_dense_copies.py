"""Dense copies (engine/dense_copies.py): a matrix kept dequantized takes torch's product for two rows or more and
keeps its blocks' kernels for one; the copies fill the VRAM left, layer by layer, never in exact mode or on the CPU.
The kernels run in Triton's interpreter on the CPU (CI), compiled where there is a GPU."""

from types import SimpleNamespace

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from triton_checks import assert_same_bits

pytest.importorskip("triton")

from engine import dense_copies  # noqa: E402
from engine.kernels import triton_blocks as tb  # noqa: E402
from engine.linear_gpu import GpuBlockLinear  # noqa: E402
from engine.memory import MIB  # noqa: E402
from engine.weights import Block, LinearStack, Projections  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
K = 256


def linear(n: int, qtype: Q = Q.Q4_K, seed: int = 0) -> GpuBlockLinear:
    return GpuBlockLinear(qtype, tb.random_blocks(qtype, n, K, torch.Generator().manual_seed(seed)), K, DEVICE)


def test_a_copy_takes_the_products_of_two_rows_or_more():
    lin = linear(24)
    one = torch.randn(1, K, device=DEVICE)
    before = lin(one)
    assert lin.keep_copy(torch.float32) == 24 * K * 4
    assert_same_bits(lin.copy, lin.matrix.dequantize())
    assert_same_bits(lin(one), before)  # one row keeps the blocks' kernel
    for rows in (2, tb.MATVEC_ROWS, 40):
        x = torch.randn(3, rows, K, device=DEVICE)
        assert_same_bits(lin(x), torch.mm(x.reshape(-1, K), lin.copy.t()).reshape(3, rows, 24))
    other = torch.randn(4, K, device=DEVICE, dtype=torch.float16)  # not the copy's dtype: the blocks' kernels
    assert_same_bits(lin(other), lin.matrix.matmul(other))


def model_of(layers: list[dict], dtype: torch.dtype = torch.float32, device: str = "cuda",
             output: GpuBlockLinear | None = None) -> SimpleNamespace:
    blocks = []
    for parts in layers:
        block = Block()
        for name, part in parts.items():
            setattr(block, name, part)
        blocks.append(block)
    return SimpleNamespace(blk=blocks, output=output, dtype=dtype, copy_bytes={},
                           placement=SimpleNamespace(on_gpu=lambda: device == "cuda"))


def with_free(monkeypatch, free: int) -> None:
    monkeypatch.setattr(dense_copies, "free_bytes", lambda device: (free, 2 * free))


def test_copies_go_layer_by_layer_while_the_vram_left_holds_them(monkeypatch):
    """q|k (one joined matrix) and v, then the output, layer after layer; the expert stacks and the norms keep no
    copy; a matrix that no longer fits is skipped, a smaller one after it still kept."""
    qk_v = [Projections([linear(16), linear(8, seed=1), linear(8, Q.Q6_K, seed=2)]) for _ in range(3)]
    outputs = [linear(32, seed=3) for _ in range(3)]
    stack = LinearStack([linear(8, seed=4)], None, 0)
    model = model_of([{"attn_qkv": qk_v[i], "attn_output": outputs[i], "ffn_up_exps": stack,
                       "attn_norm": torch.ones(K)} for i in range(3)])
    each = K * 4  # bytes a row of a copy
    # layer 0 (24 + 8 + 32 rows) and layer 1's q|k and v (32 rows) fit; its output (32) does not; layer 2's q|k (24)
    # still does
    with_free(monkeypatch, dense_copies.RESERVE + (24 + 8 + 32 + 24 + 8 + 24) * each + each // 2)
    kept = dense_copies.keep_dense_copies(model)
    qk = [p.runs[0][0] for p in qk_v]
    v = [p.runs[1][0] for p in qk_v]
    assert [m.copy is not None for m in (qk[0], v[0], outputs[0], qk[1], v[1], outputs[1], qk[2], v[2], outputs[2])] \
        == [True, True, True, True, True, False, True, False, False]
    assert stack.experts[0].copy is None
    key = dense_copies.device_key(DEVICE)
    assert (kept.matrices, kept.bytes) == (6, {key: (24 + 8 + 32 + 24 + 8 + 24) * each})
    assert kept.describe() == f"6 matrices, {kept.bytes[key] / MIB:.0f} MiB on {key}"


def test_a_matrix_past_the_cap_keeps_only_its_blocks(monkeypatch):
    big, small = linear(32), linear(8, seed=1)
    model = model_of([{"attn_output": big, "attn_v": small}])
    with_free(monkeypatch, 1 << 40)
    monkeypatch.setattr(dense_copies, "MAX_COPY_BYTES", 16 * K * 4)
    assert dense_copies.keep_dense_copies(model).matrices == 1
    assert big.copy is None and small.copy is not None


def test_a_q6_k_head_gets_a_copy_after_the_layers_where_it_fits(monkeypatch):
    """The head comes last, past the cap for the layers' matrices; a Q8_0 head keeps only its blocks."""
    monkeypatch.setattr(dense_copies, "MAX_COPY_BYTES", 16 * K * 4)
    each = K * 4
    layer, head = linear(16), linear(64, Q.Q6_K, seed=1)
    with_free(monkeypatch, dense_copies.RESERVE + 16 * each + 63 * each)  # the layer's copy, not the head's
    assert dense_copies.keep_dense_copies(model_of([{"attn_output": layer}], output=head)).matrices == 1
    assert layer.copy is not None and head.copy is None
    layer, head = linear(16), linear(64, Q.Q6_K, seed=1)
    with_free(monkeypatch, dense_copies.RESERVE + 80 * each)
    assert dense_copies.keep_dense_copies(model_of([{"attn_output": layer}], output=head)).matrices == 2
    assert layer.copy is not None and head.copy is not None
    q8_head = linear(64, Q.Q8_0, seed=2)
    assert dense_copies.keep_dense_copies(model_of([], output=q8_head)).matrices == 0
    assert q8_head.copy is None


def test_install_keeps_none_in_exact_mode_or_off_or_on_the_cpu(monkeypatch):
    with_free(monkeypatch, 1 << 40)
    lin = linear(8)
    model = model_of([{"attn_output": lin}])
    assert dense_copies.install(model, "off", exact=False) is None
    assert "exact mode" in dense_copies.install(model, "on", exact=True)
    assert dense_copies.install(model_of([{"attn_output": lin}], device="cpu"), "on", exact=False) is None
    assert lin.copy is None and model.copy_bytes == {}
    line = dense_copies.install(model, "on", exact=False)
    assert line.startswith("dense copies for windows of 2-8 rows: 1 matrices")
    assert lin.copy is not None and model.copy_bytes == {dense_copies.device_key(DEVICE): 8 * K * 4}


def test_none_fit_says_so(monkeypatch):
    with_free(monkeypatch, dense_copies.RESERVE)
    model = model_of([{"attn_output": linear(8)}])
    assert dense_copies.keep_dense_copies(model).describe() == "none (no VRAM left for them)"


def test_the_config_turns_them_on_through_the_engine_flag():
    from engine.__main__ import build_parser
    from server.config import RunConfig

    def asked(**config) -> str:
        return build_parser().parse_args(RunConfig(model="m.gguf", **config).engine_args()).dense_copies

    assert asked() == "on"
    assert asked(dense_copies=False) == "off"
    tiles = build_parser().parse_args(RunConfig(model="m.gguf", args=["--dense-tiles", "on"]).engine_args())
    assert (tiles.dense_copies, tiles.dense_tiles) == ("on", "on")
    assert build_parser().parse_args(RunConfig(model="m.gguf").engine_args()).dense_tiles == "off"


def test_q4_k_layers_and_a_q6_k_head_take_tiles_in_a_half_dtype(monkeypatch):
    """Asked for (`--dense-tiles on`), in f16 (the engine's bf16 alike) a layer's Q4_K matrices take tiles on their own blocks (no VRAM), a Q6_K head
    its values unpacked (their bytes), a layer's Q6_K matrix a copy; in float32 every one a copy."""
    from engine.kernels.triton_unpacked import unpacked_bytes

    with_free(monkeypatch, 1 << 40)
    qk, v, head = linear(16), linear(8, Q.Q6_K, seed=1), linear(64, Q.Q6_K, seed=2)
    model = model_of([{"attn_qkv": Projections([qk, v])}], dtype=torch.float16, output=head)
    assert dense_copies.keep_dense_copies(model).tiles == 0  # not asked for: copies
    qk.copy = v.copy = head.copy = None
    kept = dense_copies.keep_dense_copies(model, tiles=True)
    assert (qk.tiles is not None, qk.copy is None, v.tiles is None, v.copy is not None) == (True, True, True, True)
    assert head.tiles is not None and head.copy is None
    key = dense_copies.device_key(DEVICE)
    assert (kept.matrices, kept.tiles, kept.bytes) == (3, 2, {key: 8 * K * 2 + unpacked_bytes(64, K)})
    assert kept.describe().startswith("3 matrices (2 on tiles), ")
    x = torch.randn(5, K, device=DEVICE, dtype=torch.float16)
    assert_same_bits(qk(x), qk.tiles.matvec(x))
    assert_same_bits(head(x), head.tiles.matvec(x))
    assert_same_bits(qk(x[:1]), qk.matrix.matvec(x[:1]))  # one row keeps the blocks' kernel
    many = torch.randn(12, K, device=DEVICE, dtype=torch.float16)  # from 9 rows: dequantized, torch's product
    assert_same_bits(qk(many), torch.mm(many, qk.matrix.dequantize(dtype=torch.float16).t()))
    plain = linear(16, seed=3)
    dense_copies.keep_dense_copies(model_of([{"attn_output": plain}]), tiles=True)
    assert plain.tiles is None and plain.copy is not None
    with pytest.raises(ValueError, match="Q8_0 has no tiles"):
        linear(8, Q.Q8_0).keep_tiles()
    half = model_of([{"attn_output": linear(8, seed=5)}], dtype=torch.float16)
    assert "1 matrices (1 on tiles), 0 MiB" in dense_copies.install(half, "on", exact=False, tiles="on")
