"""The row-wise Triton kernels (engine/kernels/triton_rows.py: RMSNorm, add + RMSNorm, rope) in Triton's interpreter on
the CPU (CI), compiled where there is a GPU: against the torch code engine/layers.py ran before them
(float32 to ~1e-6; bf16/f16 within one unit in the last place of the float32 reference rounded once),
both rope styles, a row's bits the same alone as among many rows, bad inputs refused; and what
`layers.rms_norm` and `layers.Rope` compute on this machine's device."""

import pytest
import torch
from triton_checks import assert_same_bits

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytest.importorskip("triton")

from engine import layers  # noqa: E402
from engine.kernels import triton_rows as tr  # noqa: E402

EPS = 1e-6
FLOAT32 = 1e-6  # relative: float32 sums and products in another order
CONTEXT = 64
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """layers.rms_norm's torch code, in float32 (the caller rounds it to x's dtype)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf * weight.float()


def rope_reference(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool
                   ) -> torch.Tensor:
    """layers.Rope's torch code, in float32 (the caller rounds it to x's dtype)."""
    cos, sin = cos[positions][:, None, :], sin[positions][:, None, :]
    if neox:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def tables(d: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    rope = layers.Rope(d, base, CONTEXT, torch.device(DEVICE))
    return rope.cos, rope.sin


def ordered(a: torch.Tensor) -> torch.Tensor:
    """A 16-bit float's bits as integers in the order of the values (adjacent values: adjacent integers)."""
    bits = a.view(torch.int16).int()
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def assert_matches(y: torch.Tensor, reference: torch.Tensor, scale: torch.Tensor) -> None:
    """y (x's dtype) against the float32 reference: float32 within FLOAT32 of `scale`, 16-bit floats at
    most one unit in the last place from the reference rounded once."""
    assert y.shape == reference.shape
    if y.dtype == torch.float32:
        excess = (y - reference).abs() - FLOAT32 * scale
        assert (excess <= 0).all(), f"worst error {excess.max().item():.3g} over the bound"
        return
    apart = (ordered(y) - ordered(reference.to(y.dtype))).abs()
    assert apart.max().item() <= 1, f"{(apart > 1).sum().item()} values more than one unit apart"


def random_positions(n: int, seed: int) -> torch.Tensor:
    """n distinct positions in 1..CONTEXT-1, not in order."""
    return (torch.randperm(CONTEXT - 1, generator=gen(seed))[:n] + 1).to(DEVICE)


@DTYPES
@pytest.mark.parametrize("shape", [(9, 2048), (7, 5, 128), (6, 3, 96)], ids=str)
def test_rms_norm_matches_torch(dtype, shape):
    x = (torch.randn(shape, generator=gen(1)) * 3).to(DEVICE, dtype)
    weight = torch.randn(shape[-1], generator=gen(2)).to(DEVICE)
    expected = norm_reference(x, weight, EPS)
    y = tr.rms_norm(x, weight, EPS)
    assert y.dtype == dtype
    assert_matches(y, expected, expected.abs())


@pytest.mark.parametrize("shape", [(13, 2048), (11, 5, 96)], ids=str)
def test_rms_norm_row_alone_is_the_same_bits(shape):
    """A row computed alone (one masked tile) and among many rows (other programs, other tiles)."""
    x = torch.randn(shape, generator=gen(3)).to(DEVICE, torch.bfloat16)
    weight = torch.randn(shape[-1], generator=gen(4)).to(DEVICE)
    many = tr.rms_norm(x, weight, EPS)
    for i in (0, shape[0] - 1):
        assert_same_bits(tr.rms_norm(x[i:i + 1], weight, EPS), many[i:i + 1])
    if len(shape) == 3:  # one head's row alone
        assert_same_bits(tr.rms_norm(x[2, 3], weight, EPS), many[2, 3])


@DTYPES
@pytest.mark.parametrize("shape", [(9, 2048), (6, 3, 96)], ids=str)
def test_add_rms_norm_is_the_add_then_the_norm(dtype, shape):
    """One launch, the bits of torch's add and of `rms_norm` run apart, a row alone as among many."""
    x = (torch.randn(shape, generator=gen(5)) * 3).to(DEVICE, dtype)
    r = torch.randn(shape, generator=gen(6)).to(DEVICE, dtype)
    weight = torch.randn(shape[-1], generator=gen(7)).to(DEVICE)
    s, y = tr.add_rms_norm(x, r, weight, EPS)
    total = x.float() + r.float()
    if DEVICE == "cpu" and dtype == torch.bfloat16:  # the interpreter truncates float32 to bf16
        total = (total.view(torch.int32) & -65536).view(torch.float32)
    assert_same_bits(s, total.to(dtype))  # torch's add on the GPU: the float32 sum rounded once
    assert_same_bits(y, tr.rms_norm(s, weight, EPS))
    s1, y1 = tr.add_rms_norm(x[1:2], r[1:2], weight, EPS)
    assert_same_bits(s1, s[1:2])
    assert_same_bits(y1, y[1:2])
    with pytest.raises(ValueError, match="r must match"):
        tr.add_rms_norm(x, r[:1], weight, EPS)


@DTYPES
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "normal"])
@pytest.mark.parametrize("heads,d", [(20, 128), (3, 96)], ids=str)
def test_rope_matches_torch(dtype, neox, heads, d):
    """20 heads of 128: two programs of 16 heads per row (the second masked); 96: masked pairs."""
    x = (torch.randn(7, heads, d, generator=gen(5)) * 2).to(DEVICE, dtype)
    positions = random_positions(7, seed=6)
    cos, sin = tables(d)
    y = tr.rope(x, positions, cos, sin, neox)
    assert y.dtype == dtype and y.data_ptr() != x.data_ptr()
    scale = x.float().abs().amax(-1, keepdim=True).expand_as(x)  # a rotation keeps each pair's length
    assert_matches(y, rope_reference(x, positions, cos, sin, neox), scale)


@DTYPES
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "normal"])
@pytest.mark.parametrize("heads,d", [(20, 128), (3, 96)], ids=str)
def test_rope_with_its_norm_matches_torch(dtype, neox, heads, d):
    """`norm=(weight, eps)`: each head RMS-normed, then rotated, in one launch: the torch norm then rope
    in float32, rounded once (the two kernels round in between: one unit more for 16-bit floats)."""
    x = (torch.randn(7, heads, d, generator=gen(9)) * 2).to(DEVICE, dtype)
    weight = torch.randn(d, generator=gen(10)).to(DEVICE)
    positions = random_positions(7, seed=11)
    cos, sin = tables(d)
    y = tr.rope(x, positions, cos, sin, neox, (weight, EPS))
    normed = norm_reference(x, weight, EPS)
    scale = normed.abs().amax(-1, keepdim=True).expand_as(x)
    assert_matches(y, rope_reference(normed, positions, cos, sin, neox), scale)
    for i in (0, 6):
        assert_same_bits(tr.rope(x[i:i + 1], positions[i:i + 1], cos, sin, neox, (weight, EPS)), y[i:i + 1])
    with pytest.raises(ValueError, match="weight must be a float vector"):
        tr.rope(x, positions, cos, sin, neox, (weight[:-2], EPS))


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "normal"])
@pytest.mark.parametrize("normed", [True, False], ids=["normed", "plain"])
def test_rope_pair_rotates_q_and_k_in_one_launch(neox, normed):
    """q (32 heads) and k (4) of a layer, each with its own norm: each within one unit of what `rope`
    gives it alone (the pair's tiles come from both shapes), a row alone the same bits as among many."""
    q = torch.randn(5, 32, 64, generator=gen(12)).to(DEVICE, torch.bfloat16)
    k = torch.randn(5, 4, 64, generator=gen(13)).to(DEVICE, torch.bfloat16)
    wq, wk = (torch.randn(64, generator=gen(s)).to(DEVICE) for s in (14, 15))
    positions = random_positions(5, seed=16)
    cos, sin = tables(64)
    norms = ((wq, EPS), (wk, EPS)) if normed else (None, None)
    yq, yk = tr.rope_pair(q, k, positions, cos, sin, neox, *norms)
    for x, y, norm in ((q, yq, norms[0]), (k, yk, norms[1])):  # `rope` is held to the torch reference above
        assert (ordered(y) - ordered(tr.rope(x, positions, cos, sin, neox, norm))).abs().max().item() <= 1
    aq, ak = tr.rope_pair(q[2:3], k[2:3], positions[2:3], cos, sin, neox, *norms)
    assert_same_bits(aq, yq[2:3])
    assert_same_bits(ak, yk[2:3])
    with pytest.raises(ValueError, match="normed as q is"):
        tr.rope_pair(q, k, positions, cos, sin, neox, (wq, EPS), None)


def test_rope_pair_reads_column_slices_of_one_product_in_place():
    """A window's q and k are column slices of one joined product ([N, q | k | v]): read where they are, rows
    a stride apart, the same bits as from contiguous copies."""
    qkv = torch.randn(5, (32 + 4 + 4) * 64, generator=gen(17)).to(DEVICE, torch.bfloat16)
    q, k, _ = (part.reshape(5, -1, 64) for part in qkv.split([32 * 64, 4 * 64, 4 * 64], dim=1))
    assert q.data_ptr() == qkv.data_ptr() and not q.is_contiguous()  # views, as `Model.attention` gets them
    assert tr.rows_of_heads(q) is q and tr.rows_of_heads(k) is k
    wq, wk = (torch.randn(64, generator=gen(s)).to(DEVICE) for s in (18, 19))
    positions = random_positions(5, seed=20)
    cos, sin = tables(64)
    for neox in (True, False):
        yq, yk = tr.rope_pair(q, k, positions, cos, sin, neox, (wq, EPS), (wk, EPS))
        cq, ck = tr.rope_pair(q.contiguous(), k.contiguous(), positions, cos, sin, neox, (wq, EPS), (wk, EPS))
        assert yq.is_contiguous() and yk.is_contiguous()
        assert_same_bits(yq, cq)
        assert_same_bits(yk, ck)
    swapped = q.transpose(0, 1)  # heads not contiguous within a row: copied first
    assert tr.rows_of_heads(swapped).is_contiguous()


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "normal"])
def test_rope_row_alone_is_the_same_bits(neox):
    x = torch.randn(9, 4, 64, generator=gen(7)).to(DEVICE, torch.bfloat16)
    positions = random_positions(9, seed=8)
    cos, sin = tables(64)
    many = tr.rope(x, positions, cos, sin, neox)
    for i in (0, 5):
        assert_same_bits(tr.rope(x[i:i + 1], positions[i:i + 1], cos, sin, neox), many[i:i + 1])


def test_bad_inputs_are_refused():
    x, cos, sin = torch.zeros(2, 3, 8, device=DEVICE), *tables(8)
    positions = torch.tensor([1, 2], device=DEVICE)
    with pytest.raises(ValueError, match="weight must be a float vector"):
        tr.rms_norm(x, torch.ones(7, device=DEVICE), EPS)
    with pytest.raises(ValueError, match="x must be a float32/bf16/f16"):
        tr.rms_norm(x.double(), torch.ones(8, device=DEVICE), EPS)
    with pytest.raises(ValueError, match="D even"):
        tr.rope(torch.zeros(2, 3, 7, device=DEVICE), positions, cos, sin, True)
    with pytest.raises(ValueError, match="positions must be"):
        tr.rope(x, positions[:1], cos, sin, True)
    with pytest.raises(ValueError, match="positions must be"):
        tr.rope(x, positions.float(), cos, sin, True)
    with pytest.raises(ValueError, match="cos must be a float32 table"):
        tr.rope(x, positions, cos.double(), sin, True)
    with pytest.raises(ValueError, match="sin must be a float32 table"):
        tr.rope(x, positions, cos, sin[:, :3], True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_layers_norm_and_rope_on_this_device(dtype):
    """What the models call (CUDA: the Triton kernels; CPU: the C ops for float32, torch otherwise)."""
    x = torch.randn(5, 4, 64, generator=gen(9)).to(DEVICE, dtype)
    weight = torch.randn(64, generator=gen(10)).to(DEVICE)
    expected = norm_reference(x, weight, EPS)
    assert_matches(layers.rms_norm(x, weight, EPS), expected, expected.abs())
    positions = random_positions(5, seed=11)
    for neox in (True, False):
        rope = layers.Rope(64, 10000.0, CONTEXT, torch.device(DEVICE), neox=neox)
        scale = x.float().abs().amax(-1, keepdim=True).expand_as(x)
        assert_matches(rope(x, positions), rope_reference(x, positions, rope.cos, rope.sin, neox), scale)


def test_no_dependent_launch_off_the_gpu():
    """`pdl.launch`: no programmatic dependent launch for CPU tensors (Triton's interpreter), so every
    kernel's `wait` compiles to nothing there."""
    from engine.kernels import pdl

    assert pdl.launch(torch.device("cpu")) == {"PDL": False}
