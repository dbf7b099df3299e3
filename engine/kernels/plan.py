"""A CPU decode step as the list of its C calls, replayed in one call (plan_cpu.c).

`Recording` takes down every kernel call made through `cpu.call` while a step runs eagerly, and refuses the
step (`refused` says why) when it did anything a replay would miss: a call a plan cannot hold, or a torch
call that computes something (a planned step may only allocate and take views in torch: its arithmetic is all
in the C calls): a result in new memory, a write in place, a value read into Python. It watches torch at the
Python level (a `TorchFunctionMode`: a dispatch mode would import torch._dynamo, 1.4 s of the first window).
`Plan` holds the calls and every tensor the step allocated, so that a replay reads and writes where the
recorded step did.
"""

from __future__ import annotations

import ctypes
import threading

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from engine.kernels import cpu

ALLOCATIONS = {torch.empty, torch.empty_like, torch.Tensor.new_empty}
# what hands a tensor's values to Python: a replay would keep the recorded step's
READS_VALUES = {"item", "tolist", "numpy", "__int__", "__float__", "__bool__", "__index__", "equal", "allclose"}
_FLOATS = (ctypes.c_float, ctypes.c_double)


class _Arg(ctypes.Union):
    _fields_ = [("i", ctypes.c_int64), ("f", ctypes.c_double)]


class Recording(TorchFunctionMode):
    """Active (`with Recording() as r:`) while one step runs: its calls in `calls`, its allocations in `kept`."""

    def __init__(self):
        super().__init__()
        self.thread = threading.get_ident()  # the step's (the mode sees this thread's torch calls only)
        self.calls: list[tuple[str, list[int | float]]] = []
        self.kept: list[torch.Tensor] = []
        self.refused: str | None = None

    def __enter__(self) -> Recording:
        if cpu.recording is not None:
            raise RuntimeError("a CPU plan is being recorded already")
        cpu.recording = self
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        cpu.recording = None
        super().__exit__(*exc)

    def add(self, name: str, args: tuple) -> None:
        """The call `name(*args)` just made (the step's, when made on its thread)."""
        if threading.get_ident() != self.thread:
            return
        lib = cpu.library()
        if lib.sd_plan_op(name.encode()) < 0 or len(args) > lib.sd_plan_args():
            self.refuse(f"{name} is not replayable")
        types = getattr(lib, name).argtypes
        self.calls.append((name, [float(a) if t in _FLOATS else int(a or 0) for a, t in zip(args, types, strict=True)]))

    def refuse(self, why: str) -> None:
        self.refused = self.refused or why

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
        if func in ALLOCATIONS:
            self.kept.append(out)
        elif name in READS_VALUES or "out" in kwargs or (name.endswith("_") and not name.endswith("__")):
            self.refuse(f"torch's {name} reads or writes tensor values outside the C kernels")
        elif not _views_of(out, (*args, *kwargs.values())):
            self.refuse(f"torch's {name} computes outside the C kernels")
        return out


def _storages(values: object) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tree_leaves(values) if isinstance(t, torch.Tensor)}


def _views_of(out: object, inputs: tuple) -> bool:
    """Whether every tensor in `out` shares its memory with one of `inputs` (a view, or an input itself)."""
    return _storages(out) <= _storages(inputs)


class Plan:
    """The calls of a `Recording` that was not refused, replayed by `run`."""

    def __init__(self, recording: Recording):
        if recording.refused:
            raise ValueError(f"this step cannot be planned: {recording.refused}")
        lib = cpu.library()

        class Step(ctypes.Structure):
            _fields_ = [("op", ctypes.c_int64), ("a", _Arg * lib.sd_plan_args())]

        self.names = [name for name, _ in recording.calls]
        self.steps = (Step * len(recording.calls))()
        for step, (name, args) in zip(self.steps, recording.calls, strict=True):
            step.op = lib.sd_plan_op(name.encode())
            for slot, value in zip(step.a, args, strict=False):
                if isinstance(value, float):
                    slot.f = value
                else:
                    slot.i = value
        self.kept = recording.kept
        self._run = lib.sd_run_plan

    def run(self) -> None:
        with cpu.profiled(f"cpu plan of {len(self.names)} calls"):
            failed = self._run(ctypes.addressof(self.steps), len(self.names))
        if failed:
            raise RuntimeError(f"a CPU plan's call {self.names[failed - 1]} failed (out of memory or a bad id)")
