"""Programmatic dependent launch (PDL): each Triton kernel of a forward may be launched while the one
before it still runs, and waits for it on the device.

A decode window is ~230 short launches replayed from a CUDA graph; between two of them the GPU idles
for the launch (0.86 us a trivial launch in a graph on an H200, 0.57 us with PDL; 1.26 against 0.75 us
with 132 programs). With PDL (compute capability 9.0 and later) a kernel lets the next one start once
all its programs have begun (`gdc_launch_dependents`), and every kernel begins with `gdc_wait`, which
returns once the kernel before it has finished and its writes are visible: no load or store comes
before it, so the results are the same bits as without PDL. Kernels launched without PDL (torch's,
and every kernel on older GPUs or in Triton's interpreter) wait for the one before as usual.

Every kernel here calls `wait(PDL)` first and is launched with `**launch(device)`.
`STRATA_PDL=0` turns it off (to compare).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def wait(PDL: tl.constexpr):
    """Wait for the kernel before this one (PDL 2: let the next one launch first): call before any load."""
    if PDL == 2:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()


@functools.cache
def _mode(device: torch.device) -> int:
    interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"
    wanted = int(os.environ.get("STRATA_PDL", "0"))
    hopper = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
    return wanted if hopper and not interpreted else 0


def launch(device: torch.device) -> dict:
    """The launch arguments for a kernel on `device`: `PDL` for its `wait`, and Triton's `launch_pdl`."""
    mode = _mode(device)
    return {"PDL": mode, "launch_pdl": True} if mode else {"PDL": 0}
