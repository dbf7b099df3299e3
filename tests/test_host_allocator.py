"""engine/host_allocator.py: a prompt chunk's tensors reuse freed pages once the engine sets glibc's thresholds."""

import ctypes
import subprocess
import sys

import pytest

from engine.kernels import cpu

GLIBC = sys.platform.startswith("linux") and hasattr(ctypes.CDLL(None), "gnu_get_libc_version")
# A 512-row chunk's q heads normed, rotated and joined (8 MiB tensors), as a prompt read's attention makes them.
SCRIPT = """
import resource, sys, torch
from engine.host_allocator import keep_freed_blocks
from engine.kernels import ops
print(keep_freed_blocks() if sys.argv[1] == "keep" else "-")
x, w, pos = torch.randn(512, 5120), torch.ones(128), torch.arange(512)
cos, sin = torch.randn(600, 64), torch.randn(600, 64)
def step():
    q = ops.rope(ops.rms_norm(x[:, :4096].reshape(512, 32, 128), w, 1e-6), pos, cos, sin, True)
    return torch.cat([q[:256], q[256:]])[0, 0, 0].item()
for _ in range(3):
    step()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
"""


def faults(mode: str, env: dict[str, str] | None = None) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path), **(env or {})}).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not GLIBC or not cpu.available(), reason="glibc's mallopt and the CPU kernels")
def test_a_chunks_tensors_reuse_freed_pages():
    """Twenty steps of 8 MiB tensors: with glibc's defaults their pages fault in again (about half of them each
    step, measured 4,096 faults), with the thresholds set they come back without a fault; MALLOC_MMAP_THRESHOLD_ in
    the environment is the process's own choice, left alone."""
    assert faults("default")[1] > 1000
    applied, kept = faults("keep")
    assert applied == "True" and kept < 100, kept
    assert faults("keep", {"MALLOC_MMAP_THRESHOLD_": "131072"})[0] == "False"
