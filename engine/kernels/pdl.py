"""Programmatic dependent launch (PDL): each Triton kernel of a forward is launched before the one ahead
of it has finished, and waits for it on the device.

A decode window is ~200 short launches replayed from a CUDA graph, and between two of them the GPU idles
while the next is launched (0.86 us a launch of a trivial kernel in a graph on an H200, 0.57 us with
PDL). With PDL (compute capability 9.0 and later) the launch is done while the kernel ahead runs, and
every kernel begins with `gdc_wait`, which returns once that kernel has finished and its writes are
visible: no load or store comes before it, so the results are the same bits as without PDL. A one-row
Q4_K_M window's replay went 0.914 -> 0.894 ms. Letting the next kernel start early as well
(`gdc_launch_dependents` first thing) was slower end to end (1.021 -> 1.083 ms): its programs took
places on the SMs before the one ahead had finished.

Kernels launched without PDL (torch's, and every kernel on older GPUs or in Triton's interpreter) wait
for the one ahead as usual. Every kernel here calls `wait(PDL)` first and is launched with
`**launch(device)`; `STRATA_PDL=0` turns it off (to compare).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait


@triton.jit
def wait(PDL: tl.constexpr):
    """Wait for the kernel ahead of this one to finish: call first, before any load or store."""
    if PDL:
        gdc_wait()


@functools.cache
def _enabled(device: torch.device) -> bool:
    interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"
    wanted = os.environ.get("STRATA_PDL", "1") != "0"
    return wanted and not interpreted and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def launch(device: torch.device) -> dict:
    """The launch arguments for a kernel on `device`: `PDL` for its `wait`, and Triton's `launch_pdl`."""
    return {"PDL": True, "launch_pdl": True} if _enabled(device) else {"PDL": False}
