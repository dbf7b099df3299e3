"""x rounded to int16 (or int8) per 32 values, for the decode kernels that sum weights and x in integers.

A row's values in groups of 32 become int16 q = round(x / s) with s = max |x| / 32767 (the CPU's
default activations, `cpu_activations int16`), and each group keeps its float sum for the K types'
minimums. The kernels then multiply 4-bit weights by two x values at a time and add in int32 (PTX
`dp2a`): one instruction where the float path spends six to eight on unpacking, converting and
multiplying. Rounded to int8 instead (s = max |x| / 127, llama.cpp's rounding, `cpu_activations int8`),
x takes half the bytes and four values an instruction (`dp4a`), for ~250x the rounding error (4e-3 of a
group's largest |x|): the MoE's windows of 2-8 rows where `Tiles.int8_windows` says so. `dp2a` and `dp4a`
run on the GPU only; Triton's interpreter (CI) takes the same sums in plain integer operations.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels import pdl

GROUP = 32  # x values per scale
ASM = os.environ.get("TRITON_INTERPRET", "0") != "1"  # read when the kernels are defined, as Triton does


@triton.jit
def _ptx(op: tl.constexpr, a, b, acc):
    """The PTX instruction `op` ("dp2a.lo.s32.u32" and the like) of int32 a, b and acc, elementwise."""
    return tl.inline_asm_elementwise(op + " $0, $1, $2, $3;", "=r,r,r,r", [a, b, acc], dtype=tl.int32, is_pure=True,
                                     pack=1)


@triton.jit
def _dp2a(x_pairs, w_bytes, acc, HI: tl.constexpr, ASM: tl.constexpr):
    """acc + the two int16 values of `x_pairs` times bytes 0-1 (HI: 2-3) of `w_bytes`, unsigned."""
    if ASM:
        out = _ptx("dp2a.hi.s32.u32" if HI else "dp2a.lo.s32.u32", x_pairs, w_bytes, acc)
    else:
        sh: tl.constexpr = 16 if HI else 0
        out = acc + ((x_pairs << 16) >> 16) * ((w_bytes >> sh) & 255) + (x_pairs >> 16) * ((w_bytes >> (sh + 8)) & 255)
    return out


@triton.jit
def _dp4a(x_quads, w_bytes, acc, SIGNED: tl.constexpr, ASM: tl.constexpr):
    """acc + the four int8 values of `x_quads` times the four bytes of `w_bytes`, unsigned (SIGNED: int8)."""
    if ASM:
        out = _ptx("dp4a.s32.s32" if SIGNED else "dp4a.s32.u32", x_quads, w_bytes, acc)
    else:
        out = acc
        for i in tl.static_range(4):
            if SIGNED:
                w = (w_bytes << (24 - 8 * i)) >> 24
            else:
                w = (w_bytes >> (8 * i)) & 255
            out += ((x_quads << (24 - 8 * i)) >> 24) * w
    return out


@triton.jit
def round_groups(v, g, live, q, scale, sums, halves, hi, lo, r, k, G: tl.constexpr, PLANES: tl.constexpr):
    """Row r's G groups g ([G, 1]; `live` where g < k // 32) of float32 values v [G, 32], rounded into the
    `RoundedRows` tensors q, scale, sums, halves of rows of k values (PLANES: int16 q's int8 planes into hi and
    lo too, as `RoundedRows.planes` splits them): `_round_kernel`'s body, which other kernels call on the values
    they have just stored. q int16 or int8 (its largest value from its type)."""
    i = tl.arange(0, 32)[None, :]
    if q.dtype.element_ty == tl.int8:
        largest = 127.0
    else:
        largest = 32767.0
    top = tl.max(tl.abs(v), axis=1, keep_dims=True)
    inverse = tl.where(top > 0, largest / tl.where(top > 0, top, 1.0), 0.0)
    rounded = tl.floor(v * inverse + 0.5).to(tl.int32)
    tl.store(q + r * k + g * 32 + i, rounded.to(q.dtype.element_ty), mask=live)
    tl.store(scale + r * (k // 32) + g, top / largest, mask=live)
    tl.store(sums + r * (k // 32) + g, tl.sum(v, axis=1, keep_dims=True), mask=live)
    half = tl.sum(tl.reshape(rounded, (G, 2, 16)), axis=2)  # [groups, 2]: each 16 values' q summed
    tl.store(halves + r * (k // 16) + g * 2 + tl.arange(0, 2)[None, :], half, mask=live)
    if PLANES:
        _store_planes(hi, lo, r * k + g * 32 + i, rounded, live)


@triton.jit
def _planes_of(q):
    """Integer values q (int16's range) as two int8 planes hi = q >> 8, lo = (q & 255) - 128, so q = 256 hi + lo +
    128 exactly (the tensor cores' int8 products take x so)."""
    return (q >> 8).to(tl.int8), ((q & 255) - 128).to(tl.int8)


@triton.jit
def _store_planes(hi, lo, at, q, live):
    """q's planes (`_planes_of`) stored at `at`."""
    q_hi, q_lo = _planes_of(q)
    tl.store(hi + at, q_hi, mask=live)
    tl.store(lo + at, q_lo, mask=live)


@triton.jit
def _round_kernel(x, q, scale, sums, halves, k, BK: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)
    r = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * (BK // 32) + tl.arange(0, BK // 32)[:, None]
    live = g < k // 32
    v = tl.load(x + r * k + g * 32 + tl.arange(0, 32)[None, :], mask=live, other=0.0).to(tl.float32)
    round_groups(v, g, live, q, scale, sums, halves, q, q, r, k, BK // 32, False)


@triton.jit
def _planes_kernel(q, hi, lo, total, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)
    at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = at < total
    _store_planes(hi, lo, at, tl.load(q + at, mask=live, other=0), live)


@dataclass(frozen=True)
class RoundedRows:
    """Rows of x as int16 (or int8) `q` [m, k], with float32 `scale` and `sums` [m, k // 32] per group and the
    int32 sums of q per 16 values, `halves` [m, k // 16] (Q6_K's offset of 32 is taken off in integers); `hi`
    and `lo`, int16 q's int8 planes, where the kernel that rounded x split them too (`planes`)."""

    q: torch.Tensor
    scale: torch.Tensor
    sums: torch.Tensor
    halves: torch.Tensor
    hi: torch.Tensor | None = None
    lo: torch.Tensor | None = None

    @classmethod
    def empty(cls, m: int, k: int, device: torch.device, dtype: torch.dtype = torch.int16,
              planes: bool = False) -> RoundedRows:
        """Room for m rows (with `planes`, for int16 q's planes too)."""
        if planes and dtype != torch.int16:
            raise ValueError(f"planes split int16 values, not {dtype}")

        def plane() -> torch.Tensor | None:
            return torch.empty(m, k, dtype=torch.int8, device=device) if planes else None

        return cls(torch.empty(m, k, dtype=dtype, device=device),
                   torch.empty(m, k // GROUP, dtype=torch.float32, device=device),
                   torch.empty(m, k // GROUP, dtype=torch.float32, device=device),
                   torch.empty(m, k // 16, dtype=torch.int32, device=device), plane(), plane())

    @classmethod
    def for_window(cls, m: int, k: int, device: torch.device) -> RoundedRows:
        """Room for a decode window's m rows, as a kernel that writes and rounds them fills it: with planes where
        windows of 2-8 rows take them on `device` (`want(device, planes=True)`)."""
        return cls.empty(m, k, device, planes=m > 1 and device in _planes_wanted)

    @classmethod
    def of(cls, x: torch.Tensor, dtype: torch.dtype = torch.int16) -> RoundedRows:
        """x [m, k] (contiguous, k a multiple of 32) rounded group by group to `dtype` (int16 or int8); each row
        on its own. The rounding a kernel made beside x (`remember`) when there is one, else one launch."""
        m, k = x.shape
        if k % GROUP or not x.is_contiguous():
            raise ValueError(f"x must be contiguous with k a multiple of {GROUP}, got {tuple(x.shape)}")
        if dtype not in (torch.int16, torch.int8):
            raise ValueError(f"x rounds to int16 or int8, not {dtype}")
        made = _made.get(x.device)
        if made is not None and made[2].q.dtype == dtype and _same(made[0], made[1], x):
            return made[2]
        out = cls.empty(m, k, x.device, dtype)
        if m:
            _round_kernel[(m, triton.cdiv(k // GROUP, 8))](x, out.q, out.scale, out.sums, out.halves, k,
                                                           BK=8 * GROUP, **pdl.launch(x.device))
        return out

    def planes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """q (int16) as two int8 [m, k] planes for the tensor cores' int8 products: hi = q >> 8 and
        lo = (q & 255) - 128, so q = 256 hi + lo + 128 exactly. Those the rounding kernel split (no launch), else
        one launch."""
        if self.q.dtype != torch.int16:
            raise ValueError(f"planes split int16 values, not {self.q.dtype}")
        if self.hi is not None and self.lo is not None:
            return self.hi, self.lo
        hi, lo = torch.empty_like(self.q, dtype=torch.int8), torch.empty_like(self.q, dtype=torch.int8)
        if self.q.numel():
            block = 1024
            _planes_kernel[(triton.cdiv(self.q.numel(), block),)](self.q, hi, lo, self.q.numel(), BLOCK=block,
                                                                  **pdl.launch(self.q.device))
        return hi, lo

    @staticmethod
    def kernel_args(rounded: RoundedRows | None, stand_in: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], dict]:
        """What a kernel that writes rows and rounds them takes (`round_groups`): q, scale, sums, halves, hi, lo
        (`stand_in` for each where the rows are not rounded, q for the planes where there are none), and its ROUND
        and PLANES flags."""
        if rounded is None:
            return (stand_in,) * 6, dict(ROUND=False, PLANES=False)
        planes = (rounded.hi, rounded.lo) if rounded.hi is not None else (rounded.q, rounded.q)
        return (rounded.q, rounded.scale, rounded.sums, rounded.halves, *planes), dict(ROUND=True,
                                                                                       PLANES=rounded.hi is not None)

    @staticmethod
    def want(device: torch.device, planes: bool = False) -> None:
        """Say that a product on `device` takes x rounded (a matrix or an expert stack of a `ROUNDED` type), so
        that the kernels that write x round it (`wanted`); none on a device: they leave it (Q8_0, F16 files).
        `planes`: a product takes 2-8 rows as the int16 values' int8 planes (the tensor cores' dense products),
        so that those kernels split windows of 2-8 rows too (`for_window`). "cuda" is the current CUDA device, as
        its tensors name it ("cuda:0"), which the kernels look up."""
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        _wanted.add(device)
        if planes:
            _planes_wanted.add(device)

    @staticmethod
    def wanted(device: torch.device) -> bool:
        return device in _wanted

    def remember(self, x: torch.Tensor) -> None:
        """Say that these are x's rows rounded (a kernel that wrote x rounded it in the same launch), so that
        `of(x)` returns them: the products that read x (q/k/v, `attn_output`, the experts' gate and up, the
        head) then skip the rounding launch.
        One per device is kept, with x itself: its memory cannot be reused while it is remembered, and a
        write into x (its version) forgets it, except under `torch.inference_mode` (the engine's), whose
        tensors count no versions: nothing writes into a kernel's output there."""
        _made[x.device] = (x, _version(x), self)


_made: dict[torch.device, tuple[torch.Tensor, int, RoundedRows]] = {}
_wanted: set[torch.device] = set()
_planes_wanted: set[torch.device] = set()


def _same(a: torch.Tensor, version: int, b: torch.Tensor) -> bool:
    """Whether b is (a view of) a as it was at `version`: the same memory, layout and dtype, not written since
    (a view shares its base's version counter)."""
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
            and _version(b) == version)


def _version(x: torch.Tensor) -> int:
    return -1 if x.is_inference() else x._version
