"""The C CPU kernels (engine/kernels): exact dequantization against gguf-py, matmul accuracy (float,
int16 and int8 activations), and batch invariance (a result row does not depend on the batch size or the
thread count)."""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as Q

from engine.kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"CPU kernels unavailable: {cpu.unavailable_reason()}")

# gguf-py quantizes these; the K types it only dequantizes, so their blocks are random bytes with
# finite f16 scales at these byte offsets.
QUANTIZABLE = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)
F16_FIELDS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)
M = 8


def k_for(qtype: Q) -> int:
    # The float types take any k: 517 exercises the 8-wide and scalar tails.
    return 517 if qtype in FLOAT_TYPES else 512


def n_for(qtype: Q, k: int) -> int:
    # Enough bytes that sd_matmul uses both threads, and odd, so that one weight row goes unpaired.
    return max(64, 131072 // cpu.row_bytes(qtype, k)) | 1


def random_blocks(qtype: Q, n: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if qtype in QUANTIZABLE:
        data = quants.quantize(rng.standard_normal((n, k), dtype=np.float32), qtype)
        return np.ascontiguousarray(data).view(np.uint8).reshape(n, -1)
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        scale = (rng.standard_normal((n, k // block, 1)) * 0.05).astype(np.float16)
        blocks[..., offset:offset + 2] = scale.view(np.uint8)
    return blocks.reshape(n, -1)


def reference(qtype: Q, blocks: np.ndarray, k: int) -> np.ndarray:
    return np.asarray(quants.dequantize(blocks, qtype), dtype=np.float32).reshape(blocks.shape[0], k)


@pytest.fixture(params=cpu.SUPPORTED, ids=lambda t: t.name)
def case(request: pytest.FixtureRequest) -> tuple[Q, int, np.ndarray]:
    qtype = request.param
    k = k_for(qtype)
    return qtype, k, random_blocks(qtype, n_for(qtype, k), k)


@pytest.fixture
def threads():
    """Set torch's thread count (which the kernels use) for one test."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_supported_types_agree_with_the_library():
    lib = cpu.library()
    for qtype in cpu.SUPPORTED:
        assert lib.sd_supported(int(qtype)) == 1
        block, size = GGML_QUANT_SIZES[qtype]
        assert cpu.row_bytes(qtype, 4 * 256) == 4 * 256 // block * size
    assert lib.sd_supported(int(Q.IQ2_XXS)) == 0
    assert cpu.unavailable_reason() is None


def test_dequantize_matches_gguf_py_exactly(case, threads):
    qtype, k, blocks = case
    ref = reference(qtype, blocks, k)
    for n_threads in (1, 2):
        threads(n_threads)
        got = cpu.dequantize(qtype, torch.from_numpy(blocks), k).numpy()
        assert got.shape == ref.shape
        assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))


def test_matmul_matches_float64(case):
    qtype, k, blocks = case
    w = torch.from_numpy(reference(qtype, blocks, k)).double()
    x = torch.randn(M, k, generator=torch.Generator().manual_seed(1))
    y = cpu.matmul(qtype, torch.from_numpy(blocks), k, x, activations="float")
    exact = x.double() @ w.T
    # float32 accumulation error is bounded by a small multiple of eps * sum |x w|
    bound = 1e-5 * (x.double().abs() @ w.abs().T)
    assert y.shape == (M, blocks.shape[0])
    assert ((y.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("mode, levels", (("int16", 32767), ("int8", 127)))
def test_integer_matmul_error_is_the_rounding_of_x(case, mode, levels):
    """Integer modes differ from the exact product only by x's rounding per block of x (32 values,
    or 256 for the K types summed per super-block: at most half a step, max|block| / (2 * levels),
    per value) and float32 accumulation."""
    qtype, k, blocks = case
    if not cpu.has_integer(qtype):
        pytest.skip(f"{qtype.name} has no integer path (float types)")
    w = torch.from_numpy(reference(qtype, blocks, k)).double()
    x = torch.randn(M, k, generator=torch.Generator().manual_seed(4))
    y = cpu.matmul(qtype, torch.from_numpy(blocks), k, x, activations=mode)
    exact = x.double() @ w.T
    b = cpu.x_block(qtype)
    step = x.double().abs().view(M, -1, b).amax(-1, keepdim=True).expand(-1, -1, b).reshape(M, k) / (2 * levels)
    bound = step @ w.abs().T * 1.001 + 1e-5 * (x.double().abs() @ w.abs().T)
    assert ((y.double() - exact).abs() <= bound).all()
    assert not torch.equal(y, cpu.matmul(qtype, torch.from_numpy(blocks), k, x, activations="float"))


@pytest.mark.parametrize("mode", tuple(cpu.ACTIVATIONS))
def test_matmul_is_batch_invariant(case, threads, mode):
    qtype, k, blocks = case
    w = torch.from_numpy(blocks)
    x = torch.randn(M, k, generator=torch.Generator().manual_seed(2))
    threads(1)
    alone = torch.cat([cpu.matmul(qtype, w, k, x[i:i + 1], activations=mode) for i in range(M)])
    for n_threads in (1, 2):
        threads(n_threads)
        for m in range(1, M + 1):
            y = cpu.matmul(qtype, w, k, x[:m], activations=mode)
            assert torch.equal(y.view(torch.int32), alone[:m].view(torch.int32)), (n_threads, m)


def test_matmul_writes_into_out():
    k, blocks = 64, torch.from_numpy(random_blocks(Q.Q8_0, 5, 64))
    x = torch.randn(3, k)
    out = torch.full((3, 5), float("nan"))
    assert cpu.matmul(Q.Q8_0, blocks, k, x, out=out) is out
    assert torch.equal(out, cpu.matmul(Q.Q8_0, blocks, k, x))


def test_bad_input_raises_value_error():
    k = 64
    blocks = torch.from_numpy(random_blocks(Q.Q8_0, 4, k))
    x = torch.randn(2, k)
    with pytest.raises(ValueError, match="uint8"):
        cpu.matmul(Q.Q8_0, blocks.float(), k, x)
    with pytest.raises(ValueError, match="bytes per row"):
        cpu.matmul(Q.Q8_0, blocks[:, :-2].contiguous(), k, x)
    with pytest.raises(ValueError, match="multiple"):
        cpu.matmul(Q.Q8_0, blocks, 48, x)
    with pytest.raises(ValueError, match="multiple"):
        cpu.dequantize(Q.Q4_K, blocks, 100)
    with pytest.raises(ValueError, match="contiguous"):
        cpu.matmul(Q.Q8_0, torch.cat([blocks, blocks], dim=1)[:, ::2], k, x)
    with pytest.raises(ValueError, match="x must be"):
        cpu.matmul(Q.Q8_0, blocks, k, x.double())
    with pytest.raises(ValueError, match="x must be"):
        cpu.matmul(Q.Q8_0, blocks, k, torch.randn(2, k + 32))
    with pytest.raises(ValueError, match="out must be"):
        cpu.matmul(Q.Q8_0, blocks, k, x, out=torch.empty(2, 5))
    with pytest.raises(ValueError, match="not supported"):
        cpu.row_bytes(Q.IQ2_XXS, 256)
    with pytest.raises(ValueError, match="activations must be one of float, int16, int8"):
        cpu.matmul(Q.Q8_0, blocks, k, x, activations="int4")


def test_unavailable_is_reported_not_raised(monkeypatch, tmp_path):
    monkeypatch.setenv("STRATA_DESK_KERNELS", str(tmp_path / "kernels"))
    for name, value in (("_lib", None), ("_reason", None), ("_tried", False)):
        monkeypatch.setattr(cpu, name, value)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert not cpu.available()
    assert "no C compiler" in cpu.unavailable_reason()
    with pytest.raises(RuntimeError, match="unavailable"):
        cpu.matmul(Q.Q8_0, torch.zeros(1, 34, dtype=torch.uint8), 32, torch.zeros(1, 32))

    monkeypatch.delenv("CC")
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(cpu, "SOURCES", (broken,))
    monkeypatch.setattr(cpu, "_tried", False)
    assert not cpu.available()
    assert "failed" in cpu.unavailable_reason()


def test_kernel_cache_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("STRATA_DESK_KERNELS", raising=False)
    monkeypatch.setenv("STRATA_DESK_HOME", str(tmp_path / "home"))
    assert cpu.cache_dir() == tmp_path / "home" / "cache" / "kernels"
    monkeypatch.setenv("STRATA_DESK_KERNELS", str(tmp_path / "shared"))
    assert cpu.cache_dir() == tmp_path / "shared"


def test_concurrent_builds_land_one_library(monkeypatch, tmp_path):
    monkeypatch.setenv("STRATA_DESK_KERNELS", str(tmp_path / "kernels"))
    source = tmp_path / "tiny.c"  # the build machinery, without the real file's compile time
    source.write_text("int sd_supported(int type) { return type == 0; }\n")
    monkeypatch.setattr(cpu, "SOURCES", (source,))
    paths, errors = [], []

    def build():
        try:
            paths.append(cpu._build())
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    workers = [threading.Thread(target=build) for _ in range(2)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert not errors and len(set(paths)) == 1
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [paths[0].name]
    assert ctypes.CDLL(str(paths[0])).sd_supported(0) == 1


def test_portable_build_agrees(case):
    """The scalar fallback (no AVX2): the same exact dequantization, accurate and invariant matmul."""
    qtype, k, blocks = case
    lib = portable_library()
    n = blocks.shape[0]
    got = np.empty((n, k), dtype=np.float32)
    lib.sd_dequantize(int(qtype), blocks.ctypes.data, n, k, got.ctypes.data, 1)
    assert np.array_equal(got.view(np.uint32), reference(qtype, blocks, k).view(np.uint32))

    x = np.random.default_rng(3).standard_normal((M, k), dtype=np.float32)
    ys = {}
    for n_threads, m in ((1, 1), (2, M)):
        y = np.empty((m, n), dtype=np.float32)
        assert lib.sd_matmul(int(qtype), blocks.ctypes.data, n, k, x.ctypes.data, m, y.ctypes.data, n_threads, 1) == 0
        ys[m] = y
    assert np.array_equal(ys[M][:1].view(np.uint32), ys[1].view(np.uint32))
    exact = x.astype(np.float64) @ got.astype(np.float64).T
    assert (np.abs(ys[M] - exact) <= 1e-5 * (np.abs(x) @ np.abs(got).T)).all()


_portable: list[ctypes.CDLL] = []


def portable_library() -> ctypes.CDLL:
    if not _portable:
        _portable.append(cpu._open(("-DSD_PORTABLE",)))
    return _portable[0]
