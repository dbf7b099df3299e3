"""CPU kernels for GGUF quantized weights, in C (quant_cpu.c, threads from pool.c) through ctypes.

The C files are compiled on first use with the system compiler (`CC`, else `cc`) into a cache
directory, keyed by a hash of the sources, the flags, the compiler and the CPU, and loaded from
there afterwards. Nothing is built or raised at import: `available()` says whether the kernels work
here and `unavailable_reason()` why not.

`dequantize` matches gguf-py's numpy dequantizers bit for bit. `matmul` is meant for decode (a few
rows of x): each output is one dot product computed in one fixed order, so a row of the result is
bit-identical whatever the number of rows in x and the number of threads. `activations="int16"`
rounds x to int16 per block of 32 (256 for Q4_K/Q5_K/Q6_K: `x_block`) first and takes integer dot
products: faster, within 1.5e-5 of each block's largest |x| per value; `"int8"` rounds x as llama.cpp
does (4e-3 of the block's largest |x|) for half the multiply-adds; each still bit-identical per row.
Q8_0 matrices can be packed (`pack`, `Matrix(packed=True)`: packed_cpu.c, 16 rows interleaved) for
products that keep up with the memory.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import platformdirs
import torch
from gguf import GGMLQuantizationType as Q

if TYPE_CHECKING:
    from engine.kernels.plan import Recording

SUPPORTED = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("quant_cpu.c", "packed_cpu.c", "tiles_cpu.c", "ops_cpu.c",
                                                            "moe_cpu.c", "plan_cpu.c", "pool.c", "pool.h", "quant_cpu.h",
                                                            "ops_cpu.h", "simd.h", "f16.h", "packed.h"))
# Contraction off: the C code writes its FMAs explicitly and needs plain rounding everywhere else
# (to match gguf-py exactly, and to keep one summation order).
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-pthread", "-shared", "-fPIC")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_reason: str | None = None
_tried = False


def cache_dir() -> Path:
    """`$STRATA_DESK_KERNELS` if set, else `$STRATA_DESK_HOME/cache/kernels`, else the user cache
    directory's `kernels`."""
    if os.environ.get("STRATA_DESK_KERNELS"):
        return Path(os.environ["STRATA_DESK_KERNELS"]).expanduser()
    home = os.environ.get("STRATA_DESK_HOME")
    if home:
        return Path(home).expanduser() / "cache" / "kernels"
    return Path(platformdirs.user_cache_dir("strata-desk")) / "kernels"


def _cpu_flags() -> str:
    # A -march=native library only runs on CPUs with the same features (think of a shared home).
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _build(extra_flags: tuple[str, ...] = ()) -> Path:
    """The compiled library, built now unless the cache has it; RuntimeError when it cannot be built."""
    cc = shlex.split(os.environ.get("CC") or "cc")
    if not cc or shutil.which(cc[0]) is None:
        raise RuntimeError(f"no C compiler: {cc[0] if cc else 'CC'!r} not found (set CC)")
    try:
        version = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"C compiler {cc[0]!r} does not run: {exc}") from exc
    flags = FLAGS + extra_flags
    key = hashlib.sha256()
    for part in (*(p.read_bytes() for p in SOURCES), shlex.join(cc + list(flags)).encode(), version.encode(),
                 _cpu_flags().encode()):
        key.update(part + b"\0")
    target = cache_dir() / f"quant_cpu-{key.hexdigest()[:20]}.so"
    if not target.exists():
        _compile(cc, flags, target)
    return target


def _compile(cc: list[str], flags: tuple[str, ...], target: Path) -> None:
    from engine.loading import log  # loading imports this module

    log(f"compiling the CPU kernels with {cc[0]} into {target.parent} (once for each version: ~10 s)")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".build-", suffix=".so")
    os.close(fd)
    try:
        sources = [str(p) for p in SOURCES if p.suffix == ".c"]
        proc = subprocess.run([*cc, *flags, "-o", tmp, *sources], capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"compiling the CPU kernels failed:\n{proc.stderr.strip()[-3000:]}")
        os.replace(tmp, target)  # atomic: concurrent builders each land a complete, identical file
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"compiling the CPU kernels failed: {exc}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _open(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Build (or find) and load the library, with its function signatures declared."""
    lib = ctypes.CDLL(str(_build(extra_flags)))
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.sd_supported.argtypes, lib.sd_supported.restype = [c_int], c_int
    lib.sd_row_bytes.argtypes, lib.sd_row_bytes.restype = [c_int, i64], i64
    lib.sd_dequantize.argtypes, lib.sd_dequantize.restype = [c_int, ptr, i64, i64, ptr, c_int], None
    lib.sd_matmul.argtypes, lib.sd_matmul.restype = [c_int, ptr, i64, i64, ptr, i64, ptr, c_int, c_int], c_int
    lib.sd_integer.argtypes, lib.sd_integer.restype = [c_int], c_int
    lib.sd_packs.argtypes, lib.sd_packs.restype = [c_int], c_int
    lib.sd_tiles.argtypes, lib.sd_tiles.restype = [], c_int
    lib.sd_pack.argtypes, lib.sd_pack.restype = [c_int, ptr, i64, i64, ptr, c_int], c_int
    lib.sd_dequantize_rows.argtypes = [c_int, ptr, i64, i64, ptr, i64, ptr, c_int]
    lib.sd_dequantize_rows.restype = c_int
    lib.sd_unpack_rows.argtypes, lib.sd_unpack_rows.restype = [c_int, ptr, i64, i64, ptr, i64, ptr, c_int], c_int
    lib.sd_matmul_packed.argtypes = [c_int, ptr, i64, i64, ptr, i64, ptr, c_int, c_int]
    lib.sd_matmul_packed.restype = c_int
    lib.sd_x_block.argtypes, lib.sd_x_block.restype = [c_int], c_int
    f32 = ctypes.c_float
    lib.sd_rms_norm.argtypes, lib.sd_rms_norm.restype = [ptr, i64, ptr, ptr, i64, i64, i64, f32, c_int], None
    lib.sd_rope.argtypes, lib.sd_rope.restype = [ptr, i64, ptr, ptr, i64, i64, i64, ptr, ptr, c_int, c_int], None
    lib.sd_attend_row.argtypes = [ptr, ptr, ptr, i64, i64, i64, ptr, ptr, c_int, i64, i64, i64, f32, ptr, c_int]
    lib.sd_attend_row.restype = c_int
    lib.sd_attend_rows.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, ptr, ptr, i64, i64, i64, ptr, ptr, c_int, i64,
                                   i64, f32, ptr, c_int]
    lib.sd_attend_rows.restype = c_int
    lib.sd_plan_op.argtypes, lib.sd_plan_op.restype = [ctypes.c_char_p], c_int
    lib.sd_plan_args.argtypes, lib.sd_plan_args.restype = [], c_int
    lib.sd_run_plan.argtypes, lib.sd_run_plan.restype = [ptr, i64], i64
    lib.sd_argmax.argtypes, lib.sd_argmax.restype = [ptr, i64, i64, ptr], None
    lib.sd_gated.argtypes, lib.sd_gated.restype = [c_int, ptr, i64, ptr, i64, ptr, i64, i64], None
    lib.sd_add.argtypes, lib.sd_add.restype = [ptr, ptr, ptr, i64], None
    lib.sd_add_rms_norm.argtypes, lib.sd_add_rms_norm.restype = [ptr, ptr, ptr, ptr, ptr, i64, i64, f32, c_int], None
    lib.sd_scale.argtypes, lib.sd_scale.restype = [ptr, f32, ptr, i64], None
    lib.sd_swiglu_experts.argtypes = [c_int, ptr, c_int, ptr, c_int, ptr, i64, i64, i64, ptr, i64, i64, ptr, ptr, ptr,
                                      c_int, c_int]
    lib.sd_swiglu_experts.restype = c_int
    lib.sd_route.argtypes, lib.sd_route.restype = [ptr, i64, i64, ptr, i64, i64, c_int, ptr, ptr, c_int], c_int
    return lib


def _load() -> ctypes.CDLL | None:
    global _lib, _reason, _tried
    if not _tried:
        with _lock:
            if not _tried:
                try:
                    _lib = _open()
                except (OSError, RuntimeError) as exc:
                    _reason = str(exc)
                _tried = True
    return _lib


def available() -> bool:
    """Whether the kernels are built and loaded (builds them on the first call)."""
    return _load() is not None


def unavailable_reason() -> str | None:
    """Why `available()` is False (no compiler, compile error, ...), else None."""
    _load()
    return _reason


def library() -> ctypes.CDLL:
    """The loaded kernels (engine/kernels/ops.py calls them too); RuntimeError when unavailable."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"CPU quant kernels unavailable: {_reason}")
    return lib


recording: Recording | None = None  # the plan being recorded (engine/kernels/plan.py), which `call` tells


def call(name: str, *args) -> int | None:
    """`library().<name>(*args)`: every kernel call that computes goes through here, so that a plan being
    recorded takes it down (or refuses the step: a call it cannot hold)."""
    result = getattr(library(), name)(*args)
    if recording is not None:
        recording.add(name, args)
    return result


_row_bytes: dict[tuple[int, int], int] = {}


def row_bytes(qtype: Q, k: int) -> int:
    """Bytes of one row of k values of `qtype`; ValueError for an unsupported type or a partial block."""
    n = _row_bytes.get((qtype, k))
    if n is None:
        if qtype not in SUPPORTED:
            raise ValueError(f"{Q(qtype).name} is not supported by the CPU kernels")
        n = library().sd_row_bytes(int(qtype), k)
        if n < 0:
            raise ValueError(f"k={k} is not a multiple of the {Q(qtype).name} block size")
        _row_bytes[(qtype, k)] = n
    return n


def _check_blocks(qtype: Q, blocks: torch.Tensor, k: int) -> None:
    rb = row_bytes(qtype, k)
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or not blocks.is_cpu:
        raise ValueError(f"blocks must be a 2-D uint8 CPU tensor, got {blocks.dtype} {tuple(blocks.shape)} "
                         f"on {blocks.device}")
    if blocks.shape[1] != rb:
        raise ValueError(f"blocks have {blocks.shape[1]} bytes per row; {Q(qtype).name} with k={k} needs {rb}")
    if not blocks.is_contiguous():
        raise ValueError("blocks must be contiguous")


_NOT_PROFILED = nullcontext()


def profiled(label: str) -> AbstractContextManager:
    """A range named `label` around a C call while torch's profiler records (`bench-engine --profile`), which
    otherwise sees nothing of the C kernels; nothing otherwise."""
    return torch.profiler.record_function(label) if torch.autograd._profiler_enabled() else _NOT_PROFILED


_threads = 0
# sd_matmul's codes for the activations of a product with quantized weights
ACTIVATIONS = {"float": 0, "int16": 1, "int8": 2}
_activations = "int16"


def set_threads(n: int) -> None:
    """Threads for the kernels from now on, whatever torch's own count (0: torch's)."""
    global _threads
    _threads = n


def threads() -> int:
    return _threads or torch.get_num_threads()


def set_activations(name: str) -> None:
    """The engine's choice for decode products (`Matrix.matmul(activations=None)`): `ACTIVATIONS`
    "int16" (the default), "int8" (llama.cpp's rounding) or "float"."""
    global _activations
    activation_code(name)  # refuses an unknown name
    _activations = name


def activation_code(name: str | None = None) -> int:
    """The C kernels' code for activations `name` (None: as `set_activations` chose)."""
    name = name or _activations
    if name not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, not {name!r}")
    return ACTIVATIONS[name]


def has_integer(qtype: Q) -> bool:
    """Whether `Matrix.matmul` runs integer products ("int16", "int8") for `qtype` here (AVX2 builds,
    block types); elsewhere it takes the float path."""
    return bool(library().sd_integer(int(qtype)))


def x_block(qtype: Q) -> int:
    """How many x values share one scale in the integer modes: 32, or 256 for the K types whose
    kernels sum a super-block in integers (Q4_K, Q5_K, Q6_K); 0 without an integer path."""
    return int(library().sd_x_block(int(qtype)))


PACKED_GROUP = 16  # rows interleaved together in a packed matrix (packed_cpu.c)
PACKED_STACK = 0x100  # a stack's type code | this: its blocks packed (`sd_swiglu_experts`; SD_PACKED in quant_cpu.h)


def packs(qtype: Q, n: int) -> bool:
    """Whether n rows of `qtype` can be packed here (`Matrix(packed=...)`): Q8_0 on AVX2 builds, Q5_0, Q4_K
    and Q6_K on AVX-512 (BW, VL, VNNI) ones, n a multiple of 16."""
    return n > 0 and n % PACKED_GROUP == 0 and bool(library().sd_packs(int(qtype)))


def tiles() -> bool:
    """Whether packed products (Q8_0, Q5_0, Q4_K, Q6_K) of 8-12 x rows or more run on AMX tiles here (tiles_cpu.c:
    an AMX-INT8 build on a kernel that lends the tiles), in the integer modes: the same bits as the int16 kernel,
    faster, and faster than a dequantized slab + float32 GEMM (`weights.TILED_MATVEC_ROWS`)."""
    return bool(library().sd_tiles())


def pack(qtype: Q, blocks: torch.Tensor, k: int) -> torch.Tensor:
    """The rows of `blocks` interleaved by 16 (packed_cpu.c's layout): as many bytes, a new tensor."""
    _check_blocks(qtype, blocks, k)
    out = torch.empty_like(blocks)
    if call("sd_pack", int(qtype), blocks.data_ptr(), blocks.shape[0], k, out.data_ptr(), threads()) != 0:
        raise ValueError(f"{Q(qtype).name} [{blocks.shape[0]}, {k}] has no packed layout here")
    return out


class Matrix:
    """n weight rows of `qtype` blocks (uint8 [n, row_bytes(qtype, k)]), checked once, for products
    called many times (the linears of a model). `packed`: the blocks are in packed_cpu.c's layout (rows
    interleaved by 16, from `pack`): products read 16 rows at once, at the memory's speed."""

    def __init__(self, qtype: Q, blocks: torch.Tensor, k: int, packed: bool = False):
        _check_blocks(qtype, blocks, k)
        if packed and not packs(qtype, blocks.shape[0]):
            raise ValueError(f"{Q(qtype).name} [{blocks.shape[0]}, {k}] has no packed layout here")
        self.qtype, self.blocks, self.k, self.n, self.packed = int(qtype), blocks, k, blocks.shape[0], packed
        self._product = "sd_matmul_packed" if packed else "sd_matmul"
        self._label = f"cpu {Q(qtype).name}{' packed' if packed else ''} {self.n}x{k}"

    def matmul(self, x: torch.Tensor, out: torch.Tensor | None = None,
               activations: str | None = None) -> torch.Tensor:
        """x [m, k] @ W.T -> float32 [m, n]; activations None: as `set_activations` chose."""
        k, n = self.k, self.n
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k or not x.is_cpu or not x.is_contiguous():
            raise ValueError(f"x must be a contiguous float32 CPU tensor [m, {k}], got {x.dtype} {tuple(x.shape)} "
                             f"on {x.device}")
        m = x.shape[0]
        if out is None:
            out = torch.empty((m, n), dtype=torch.float32)
        elif out.dtype != torch.float32 or out.shape != (m, n) or not out.is_cpu or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous float32 CPU tensor [{m}, {n}], got {out.dtype} "
                             f"{tuple(out.shape)} on {out.device}")
        with profiled(self._label):
            status = call(self._product, self.qtype, self.blocks.data_ptr(), n, k, x.data_ptr(), m, out.data_ptr(),
                          threads(), activation_code(activations))
        if status != 0:
            raise MemoryError("the product could not allocate its buffers")
        return out

    def dequantize(self, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """float32 rows [lo, hi) of W."""
        hi = self.n if hi is None else hi
        if self.packed:
            return self.rows(torch.arange(lo, hi))
        rows = self.blocks[lo:hi]
        out = torch.empty((rows.shape[0], self.k), dtype=torch.float32)
        call("sd_dequantize", self.qtype, rows.data_ptr(), rows.shape[0], self.k, out.data_ptr(), threads())
        return out

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 rows `ids` of W (an embedding lookup)."""
        ids = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty((ids.numel(), self.k), dtype=torch.float32)
        if call("sd_unpack_rows" if self.packed else "sd_dequantize_rows", self.qtype, self.blocks.data_ptr(), self.n,
                self.k, ids.data_ptr(), ids.numel(), out.data_ptr(), threads()):
            raise IndexError(f"row ids must be in [0, {self.n})")
        return out


def dequantize(qtype: Q, blocks: torch.Tensor, k: int) -> torch.Tensor:
    """float32 [rows, k] from uint8 blocks [rows, row_bytes(qtype, k)]."""
    return Matrix(qtype, blocks, k).dequantize()


def matmul(qtype: Q, blocks: torch.Tensor, k: int, x: torch.Tensor, out: torch.Tensor | None = None,
           activations: str | None = None) -> torch.Tensor:
    """x [m, k] @ W.T -> float32 [m, n], W being n rows of `qtype` blocks (uint8 [n, row_bytes])."""
    return Matrix(qtype, blocks, k).matmul(x, out, activations)


def _bench() -> None:
    """`python -m engine.kernels.cpu`: decode-sized matmul timings (random blocks, best and median)."""
    import statistics
    import time

    shapes = ((Q.Q8_0, 262144, 640), (Q.Q5_0, 2048, 640), (Q.Q6_K, 640, 2048), (Q.Q4_K, 640, 1024))
    t0 = time.perf_counter()
    print(f"kernels: {available()} {unavailable_reason() or ''}({time.perf_counter() - t0:.1f} s to build or load), "
          f"{torch.get_num_threads()} threads")
    for qtype, n, k in shapes:
        blocks = torch.randint(0, 256, (n, row_bytes(qtype, k)), dtype=torch.uint8)
        blocks[:, 1::2] &= 0x3F  # no inf/nan among the f16 scales wherever they are
        layouts = (False, True) if packs(qtype, n) else (False,)
        for packed, m, mode in ((p, m, mode) for p in layouts for m in (1, 4) for mode in ACTIVATIONS):
            w = Matrix(qtype, pack(qtype, blocks, k), k, packed=True) if packed else Matrix(qtype, blocks, k)
            x, out = torch.randn(m, k), torch.empty(m, n)
            times = []
            for _ in range(20 if n > 100_000 else 500):
                t0 = time.perf_counter()
                w.matmul(x, out, mode)
                times.append(time.perf_counter() - t0)
            best, median = min(times), statistics.median(times)
            print(f"{qtype.name:5}{'/16' if packed else '   '} {n:>6} x {k:<5} m={m} {mode:5}: best {best * 1e3:7.3f} ms "
                  f"({blocks.numel() / best / 1e9:5.1f} GB/s)  median {median * 1e3:7.3f} ms")


if __name__ == "__main__":
    _bench()
