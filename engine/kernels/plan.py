"""A CPU decode step as the list of its C calls, replayed in one call (plan_cpu.c).

`Recording` takes down every kernel call made through `cpu.call` while a step runs eagerly, and refuses the
step (`refused` says why) when it did anything a replay would miss: a call a plan cannot hold, or a torch
operation that computes something (a planned step may only allocate and take views in torch: its arithmetic
is all in the C calls). `Plan` holds the calls and every tensor the step allocated, so that a replay reads
and writes where the recorded step did.
"""

from __future__ import annotations

import ctypes
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.kernels import cpu

_aten = torch.ops.aten
ALLOCATIONS = {_aten.empty.memory_format, _aten.empty_like.default, _aten.empty_strided.default}
_FLOATS = (ctypes.c_float, ctypes.c_double)


class _Arg(ctypes.Union):
    _fields_ = [("i", ctypes.c_int64), ("f", ctypes.c_double)]


class Recording(TorchDispatchMode):
    """Active (`with Recording() as r:`) while one step runs: its calls in `calls`, its allocations in `kept`."""

    def __init__(self):
        super().__init__()
        self.thread = threading.get_ident()  # the step's (the dispatch mode sees this thread's operations only)
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

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in ALLOCATIONS:
            self.kept.append(out)
        elif not func.is_view:
            self.refuse(f"torch's {func} computes outside the C kernels")
        return out


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
