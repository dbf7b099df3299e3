"""Where every weight lives and in which format, and how many bytes that takes on each device.

`WeightStore` turns the GGUF tensors into what the models hold: a `Linear` per matrix, a
`LinearStack` per expert tensor and float32 vectors for norms and routers, all named like the GGUF
tensor (`blk.3.attn_q`). The format policy is decided once per tensor (`keeps_blocks`):

- CPU: quantized and 16-bit matrices keep the file's bytes and run through `engine.kernels.cpu`
  (a matvec straight from the blocks for decode rows, with int16, int8 or float32 activations as
  `--cpu-activations` chose; a dequantized slab and one GEMM for prompt chunks); Q8_0 matrices with
  rows in multiples of 16 are packed 16 rows together (`cpu_kernels.pack`: the same bytes, read at the
  memory's speed); F32 matrices are used as they are.
- CUDA: Q8_0/Q4_0/Q4_K/Q5_K/Q6_K matrices keep the file's bytes and run through the Triton kernels
  (`GpuBlockLinear`: a matvec for decode windows, a dequantize-in-tile GEMM for prompt chunks), and so
  do expert stacks of those types and of F16/BF16 (`LinearStack.blocks`, run by the fused MoE kernel of
  `engine.experts_blocks`); other types are dequantized once into the compute dtype (dense F16/BF16
  matrices run through cuBLAS, other expert stacks as bf16 grouped GEMMs).
- Without a C compiler the CPU kernels are missing, without Triton the GPU ones: matrices are
  dequantized at load, and the log says why.

Models never call `F.linear` on raw tensors and never see a weight's device or format.
"""

from __future__ import annotations

import sys
import warnings
from collections import Counter
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from engine.gguf_file import GGUFError, GGUFFile, TensorInfo
from engine.kernels import cpu as cpu_kernels
from engine.kernels import gpu as gpu_kernels
from engine.quants import load_tensor
from engine.upload import Uploader

MATVEC_ROWS = 16  # up to this many rows a block matrix runs the matvec kernel; more: slab + GEMM
# up to these rows a packed matrix's kernel (16 weight rows a load) beat a dequantized slab + float32 GEMM for every
# shape measured of its type (the demo's, qwen3-30b-a3b's, 2048 x 2048; 1.0-6.5x), and was slower for some above
PACKED_MATVEC_ROWS = {Q.Q8_0: 512, Q.Q4_K: 256, Q.Q5_0: 128, Q.Q6_K: 64}
# the same where its integer products run on AMX tiles (`cpu_kernels.tiles`): 1.4-4x a slab at every count measured
# (to 2,048) for Q8_0 and Q5_0, 1.05-2.9x for Q4_K; Q6_K 1.05-4x to 512 and 0.85-1.19x at 2,048
TILED_MATVEC_ROWS = {Q.Q8_0: sys.maxsize, Q.Q5_0: sys.maxsize, Q.Q4_K: sys.maxsize, Q.Q6_K: 512}
SLAB_BYTES = 32 << 20  # float32 bytes of one dequantized slab in a prompt-chunk product
QKV = ("attn_q", "attn_k", "attn_v")  # a layer's matrices joined into `attn_qkv` (`Projections`)
GATE_UP = ("ffn_gate", "ffn_up")  # a dense FFN's, joined into `ffn_gate_up`
MAPPED = "mapped"  # `host_experts`: the routed experts left in the file's memory map, not pinned copies
FLOATS = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}  # types a GPU gets as they are


def is_vector(info: TensorInfo) -> bool:
    """Norm weights and routers: tiny, float32, and their rounding steers everything after them."""
    return len(info.shape) == 1 or info.name.removesuffix(".weight").endswith("ffn_gate_inp")


def keeps_blocks(info: TensorInfo, device: torch.device) -> bool:
    """The format policy: does this tensor stay in the file's format on `device`?"""
    if device.type == "cuda":
        kernel_reads = (info.qtype in gpu_kernels.SUPPORTED and len(info.shape) in (2, 3)
                        or info.qtype in gpu_kernels.FLOAT_BLOCKS and len(info.shape) == 3)
        return kernel_reads and not is_vector(info) and gpu_kernels.available()
    return (device.type == "cpu" and not is_vector(info) and info.qtype != Q.F32
            and cpu_kernels.available() and info.qtype in cpu_kernels.SUPPORTED)


def resident_bytes(info: TensorInfo, device: torch.device, dtype: torch.dtype) -> int:
    """Bytes `info` takes once placed by the policy (what `WeightStore` will count)."""
    if keeps_blocks(info, device):
        return info.nbytes
    elements = int(np.prod(info.shape))
    return elements * (4 if is_vector(info) else torch.empty(0, dtype=dtype).element_size())


def planned_bytes(g: GGUFFile, device: torch.device, dtype: torch.dtype, host_experts: bool | str = False) -> int:
    """All weights' bytes on `device` before loading them (slot fitting, setup); with `host_experts` the
    routed expert stacks are in host memory, not on `device`."""
    return sum(resident_bytes(info, device, dtype) for info in g.tensors.values()
               if not (host_experts and "_exps" in info.name))


class Linear:
    """y = x @ W^T for a matrix W [out_features, in_features]; `lookup` gives rows of W (embeddings)."""

    out_features: int
    in_features: int
    nbytes: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def kind(self) -> tuple | None:
        """What must match for matrices to be joined into one (`joined`); None: never joined."""
        return None

    @classmethod
    def joined(cls, parts: list[Linear]) -> Linear:
        """One matrix of `parts`' rows in order (all of one `kind`)."""
        raise NotImplementedError


class DenseLinear(Linear):
    """A float matrix on its device (F32 files on the CPU; on CUDA what the Triton kernels do not read)."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.out_features, self.in_features = weight.shape
        self.nbytes = weight.numel() * weight.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype:
            return F.linear(x, self.weight)
        # an F16 expert stack kept for the fused kernel, in a layer whose other stacks run one by one
        return F.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)

    @cached_property
    def _c_rows(self) -> cpu_kernels.Matrix | None:
        """A float32 CPU matrix as F32 rows for the C kernels: its lookups in one call (one a CPU plan can replay)."""
        w = self.weight
        usable = w.is_cpu and w.dtype == torch.float32 and w.is_contiguous() and cpu_kernels.available()
        return cpu_kernels.Matrix(Q.F32, w.view(torch.uint8), self.in_features) if usable else None

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return self._c_rows.rows(ids).reshape(*ids.shape, self.in_features) if self._c_rows else self.weight[ids]

    def kind(self) -> tuple:
        return "dense", self.weight.dtype, self.weight.device, self.in_features

    @classmethod
    def joined(cls, parts: list[Linear]) -> Linear:
        return cls(torch.cat([p.weight for p in parts]))


class BlockLinear(Linear):
    """A matrix kept in the file's blocks on the CPU, `[out_features, row_bytes]` bytes; the kernel
    for its type is chosen once, here. Products are float32 and cast back to the input's dtype."""

    def __init__(self, qtype: Q, blocks: torch.Tensor, in_features: int, activations: str | None = None,
                 packed: bool = False):
        self.qtype = qtype
        self.activations = activations  # None: the engine's choice (cpu_kernels.set_activations)
        self.matrix = cpu_kernels.Matrix(qtype, blocks, in_features, packed)
        self.out_features = blocks.shape[0]
        self.in_features = in_features
        self.nbytes = blocks.numel()
        self.slab_rows = max(1, SLAB_BYTES // (4 * in_features))
        self.matvec_rows = PACKED_MATVEC_ROWS[qtype] if packed else MATVEC_ROWS
        self.tiled_rows = TILED_MATVEC_ROWS.get(qtype, 0) if packed and cpu_kernels.tiles() else 0

    def direct(self, rows: int) -> bool:
        """Whether `rows` x rows run the matrix's own kernel, not a dequantized slab + GEMM."""
        return rows <= self.matvec_rows or (rows <= self.tiled_rows and cpu_kernels.activation_code(self.activations) != 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == torch.float32 and self.direct(x.shape[0]):  # decode: as it comes
            return self.matrix.matmul(x.contiguous(), activations=self.activations)
        flat = x.reshape(-1, self.in_features).float().contiguous()
        if self.direct(flat.shape[0]):
            y = self.matrix.matmul(flat, activations=self.activations)
        else:
            y = torch.empty(flat.shape[0], self.out_features)
            for lo in range(0, self.out_features, self.slab_rows):
                hi = min(lo + self.slab_rows, self.out_features)
                torch.mm(flat, self.matrix.dequantize(lo, hi).t(), out=y[:, lo:hi])
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return self.matrix.rows(ids)

    def kind(self) -> tuple:
        return "blocks", self.qtype, self.in_features, self.activations, self.matrix.packed

    @classmethod
    def joined(cls, parts: list[Linear]) -> Linear:
        first = parts[0]  # packed parts are whole groups of rows: their bytes joined are packed too
        return cls(first.qtype, torch.cat([p.matrix.blocks for p in parts]), first.in_features, first.activations,
                   first.matrix.packed)


class Projections:
    """Matrices that take the same input (a layer's q, k and v: `blk.attn_qkv`; a dense FFN's gate and up:
    `blk.ffn_gate_up`), joined at load into one matrix per run of them of one kind and type
    (`Linear.kind`), so a decode step runs one product (one kernel launch) per run instead of one per
    matrix; each output is split back."""

    def __init__(self, parts: list[Linear]):
        self.runs: list[tuple[Linear, list[int]]] = []
        run: list[Linear] = []
        for part in parts:
            if run and (part.kind() is None or part.kind() != run[0].kind()):
                self._close(run)
                run = []
            run.append(part)
        self._close(run)

    def _close(self, run: list[Linear]) -> None:
        matrix = run[0] if len(run) == 1 else type(run[0]).joined(run)
        self.runs.append((matrix, [p.out_features for p in run]))

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for matrix, sizes in self.runs:
            y = matrix(x)
            out += y.split(sizes, dim=-1) if len(sizes) > 1 else [y]
        return out


@dataclass
class LinearStack:
    """A GGUF 3-D tensor of per-expert matrices `[experts, out, in]` (`blk.N.ffn_up_exps`)."""

    experts: list[Linear]
    dense: torch.Tensor | None  # the whole stack when held as one float tensor (the CUDA paths use it)
    nbytes: int
    # the whole stack's blocks when kept in them, uint8 [experts, out, row_bytes] (the fused MoE kernel
    # reads them on CUDA; the expert tier copies cache slots from them in host memory)
    blocks: torch.Tensor | None = None
    qtype: Q | None = None
    packed: bool = False  # on the CPU: each expert's blocks in packed_cpu.c's layout (`cpu_kernels.pack`)

    @classmethod
    def of_dense(cls, t: torch.Tensor) -> LinearStack:
        return cls([DenseLinear(t[e]) for e in range(t.shape[0])], t, t.numel() * t.element_size())


class Block:
    """One layer's weights as attributes named like its GGUF tensors: `blk.attn_output`, `blk.ffn_norm`;
    q, k and v are `blk.attn_qkv` (`Projections`), as llama.cpp names a fused QKV, and a dense FFN's gate
    and up `blk.ffn_gate_up`."""

    def __getattr__(self, name: str):
        raise AttributeError(f"this layer has no tensor {name!r}")


class WeightStore:
    """The model's weights, placed by the format policy on `device` (or the device a call names: a
    layer split puts each layer on its stage's), with their bytes counted per device as they are placed
    (`bytes`, `expert_bytes`, `split`). With `host_experts` (the expert tier on a GPU) the routed
    expert stacks stay in host memory in their blocks, pinned for copies to the GPU; `MAPPED`: left in
    the file's memory map instead (RAM short of them: pages read from the file as they are used)."""

    def __init__(self, g: GGUFFile, device: torch.device, dtype: torch.dtype, host_experts: bool | str = False):
        self.g = g
        self.device = device
        self.dtype = dtype
        self.host_experts = host_experts
        self.experts_device = torch.device("cpu") if host_experts else device
        # tensor name -> (bytes, format: "Q8_0 blocks", "bf16" ..., device)
        self.placed: dict[str, tuple[int, str, str]] = {}
        self.uploader = Uploader()  # a GPU's weights copied from the map through pinned buffers

    def loaded(self) -> None:
        """Every weight is placed: the uploads' staging buffers are let go."""
        self.uploader.close()

    def _info(self, name: str, dims: int | None = None) -> TensorInfo:
        info = self.g.tensors.get(name + ".weight") or self.g.tensors.get(name)
        if info is None:
            raise GGUFError(f"{self.g.path}: missing tensor {name!r}")
        if dims is not None and len(info.shape) != dims:
            raise GGUFError(f"{self.g.path}: tensor {info.name} has shape {info.shape}, expected {dims} dimensions")
        return info

    def has(self, name: str) -> bool:
        return name + ".weight" in self.g.tensors or name in self.g.tensors

    def _count(self, info: TensorInfo, nbytes: int, kept: bool, dtype: torch.dtype | None = None,
               device: torch.device | None = None, key: str | None = None) -> None:
        fmt = f"{info.qtype.name} blocks" if kept else str(dtype or self.dtype).removeprefix("torch.")
        self.placed[key or info.name] = (nbytes, fmt, str(device or self.device))

    def _blocks(self, info: TensorInfo) -> torch.Tensor:
        """The tensor's bytes copied out of the file map: `[..., out, row_bytes]` uint8."""
        return torch.from_numpy(self.g.tensor_bytes(info.name).copy())

    def _uploaded(self, info: TensorInfo, device: torch.device) -> torch.Tensor:
        """The tensor's bytes `[..., out, row_bytes]` uint8 on a GPU `device`, straight from the map."""
        return self.uploader.to(self._mapped(info), device)

    def _mapped(self, info: TensorInfo) -> torch.Tensor:
        """The tensor's bytes in the file map, not copied (read only: nothing writes weights)."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")
            return torch.from_numpy(self.g.tensor_bytes(info.name))

    def _dense(self, info: TensorInfo, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
        device = device or self.device
        if device.type == "cuda" and info.qtype in FLOATS:  # converted on the GPU, not in fresh host memory
            return self._uploaded(info, device).view(FLOATS[info.qtype]).reshape(info.shape).to(dtype)
        return load_tensor(self.g, info.name, dtype, device)

    def vector(self, name: str, device: torch.device | None = None) -> torch.Tensor:
        """A norm weight or a router, float32."""
        device = device or self.device
        info = self._info(name)
        t = self._dense(info, torch.float32, device)
        self._count(info, t.numel() * 4, kept=False, dtype=torch.float32, device=device)
        return t

    def linear(self, name: str, device: torch.device | None = None, key: str | None = None) -> Linear:
        """A matrix; `key` counts it under another name (a tied head's copy on the last stage of a split)."""
        device = device or self.device
        info = self._info(name, dims=2)
        kept = keeps_blocks(info, device)
        if kept and device.type == "cuda":
            from engine.linear_gpu import GpuBlockLinear  # imports Triton, so only when it is used

            lin: Linear = GpuBlockLinear(info.qtype, self._uploaded(info, device), info.shape[-1], device)
        elif kept and cpu_kernels.packs(info.qtype, info.shape[0]):
            blocks = cpu_kernels.pack(info.qtype, self._mapped(info), info.shape[-1])
            lin = BlockLinear(info.qtype, blocks, info.shape[-1], packed=True)
        elif kept:
            lin = BlockLinear(info.qtype, self._blocks(info), info.shape[-1])
        else:
            lin = DenseLinear(self._dense(info, self.dtype, device))
        self._count(info, lin.nbytes, kept, device=device, key=key)
        return lin

    def stack(self, name: str, device: torch.device | None = None) -> LinearStack:
        info = self._info(name, dims=3)  # [experts, out, in]
        device = self.experts_device if self.host_experts else device or self.device
        kept = keeps_blocks(info, device)
        if kept and device.type == "cuda":
            from engine.linear_gpu import GpuBlockLinear  # imports Triton, so only when it is used

            blocks = self._uploaded(info, device)
            if info.qtype in gpu_kernels.FLOAT_BLOCKS:  # the fused MoE kernel reads the values as they are
                values = blocks.view(gpu_kernels.FLOAT_DTYPE[info.qtype])
                experts: list[Linear] = [DenseLinear(values[e]) for e in range(info.shape[0])]
            else:
                experts = [GpuBlockLinear(info.qtype, blocks[e], info.shape[-1], device)
                           for e in range(info.shape[0])]
            stack = LinearStack(experts, None, blocks.numel(), blocks, info.qtype)
        elif kept:
            packed = self.device.type != "cuda" and cpu_kernels.packs(info.qtype, info.shape[1])
            if packed:  # each expert's rows packed by 16: a slice of whole groups is a packed matrix
                experts_n, rows = info.shape[:2]
                flat = self._mapped(info).reshape(experts_n * rows, -1)
                blocks = cpu_kernels.pack(info.qtype, flat, info.shape[-1]).view(experts_n, rows, -1)
            elif self.device.type != "cuda":
                blocks = self._blocks(info)
            elif self.host_experts == MAPPED:
                blocks = self._mapped(info)
            else:  # host copies the expert tier copies into VRAM slots: pinned, copied from the map once
                mapped = self._mapped(info)
                blocks = torch.empty(mapped.shape, dtype=torch.uint8, pin_memory=True).copy_(mapped)
            experts = [BlockLinear(info.qtype, blocks[e], info.shape[-1], packed=packed) for e in range(info.shape[0])]
            stack = LinearStack(experts, None, blocks.numel(), blocks, info.qtype, packed)
        else:
            stack = LinearStack.of_dense(self._dense(info, self.dtype, device))
        self._count(info, stack.nbytes, kept, device=device)
        return stack

    def block(self, i: int, device: torch.device | None = None) -> Block:
        """Layer `i`'s tensors by kind (vectors, matrices, expert stacks), on `device` (default: the store's)."""
        prefix = f"blk.{i}."
        block = Block()
        for full in self.g.tensors:
            if not full.startswith(prefix):
                continue
            name = full.removesuffix(".weight")
            info = self.g.tensors[full]
            if is_vector(info):
                part = self.vector(name, device)
            elif len(info.shape) == 3:
                part = self.stack(name, device)
            else:
                part = self.linear(name, device)
            setattr(block, name.removeprefix(prefix), part)
        for joined, names in (("attn_qkv", QKV), ("ffn_gate_up", GATE_UP)):
            if all(name in vars(block) for name in names):
                setattr(block, joined, Projections([vars(block).pop(name) for name in names]))
        return block

    def bytes(self, predicate=lambda name: True) -> int:
        return sum(n for name, (n, _, _) in self.placed.items() if predicate(name))

    def expert_bytes(self) -> int:
        return self.bytes(lambda name: "_exps" in name)

    def describe(self) -> str:
        """The formats the weights were placed in, for the log: `197 Q5_0 blocks, 109 float32`."""
        formats = Counter(fmt for _, fmt, _ in self.placed.values())
        text = ", ".join(f"{n} {fmt}" for fmt, n in formats.most_common())
        kernels = {"cpu": ("CPU", cpu_kernels), "cuda": ("GPU", gpu_kernels)}.get(self.device.type)
        reason = kernels[1].unavailable_reason() if kernels else None
        return text + (f"; {kernels[0]} kernels unavailable ({reason}): matrices dequantized" if reason else "")

    def split(self, predicate=lambda name: True) -> dict[str, int]:
        """Bytes placed per device, in the order the devices were first used (a layer split's stages, the
        host with `host_experts`)."""
        out: dict[str, int] = {}
        for name, (n, _, device) in self.placed.items():
            if predicate(name):
                out[device] = out.get(device, 0) + n
        return out
