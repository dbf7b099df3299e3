"""`engine.kernels.sass`: a kernel compiled for sm_90 without a GPU, and the occupancy it implies."""

import collections
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from engine.kernels import sass  # noqa: E402


@pytest.mark.parametrize(("registers", "warps", "expected"),
                         [(160, 1, 12), (168, 1, 12), (118, 1, 16), (79, 1, 24), (60, 1, 32), (139, 4, 12),
                          (32, 4, 64)])
def test_warps_an_sm_as_nsight_compute_counts_them(registers, warps, expected):
    # 160, 118 and 79 registers a one-warp program: 12, 16 and 24 warps, as ncu read on the H200 (2026-12-03)
    assert sass.Usage(registers, 0, 1, collections.Counter(), warps).warps_an_sm == expected


def test_a_kernel_compiles_for_sm_90_without_a_gpu():
    # in a process of its own: this one's kernels are Triton's interpreter's when there is no GPU (conftest)
    code = ("from gguf import GGMLQuantizationType as Q\nfrom engine.kernels import sass\n"
            "u = sass.dense(Q.Q6_K, sass.HEAD, sass.HIDDEN, 1)\n"
            "print(u.registers, u.stack, u.instructions, sum(u.ops.values()), u.ops['LDG'], u.ops['IDP'])\n"
            "print(u.line('Q6_K head, one row'))")
    done = subprocess.run([sys.executable, "-c", code], env=os.environ | {"TRITON_INTERPRET": "0"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    counts, line = done.stdout.splitlines()
    registers, stack, instructions, total, loads, dp2a = map(int, counts.split())
    assert 16 <= registers <= 255 and stack == 0
    assert instructions == total > 100
    assert loads > 0 and dp2a > 0  # its int16 sums: dp2a (IDP)
    assert line.startswith("Q6_K head, one row") and "warps an SM" in line


def test_interpreted_kernels_are_refused():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("kernels compiled here: the interpreter is not in use")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        sass.dense(Q.Q6_K, sass.HEAD, sass.HIDDEN, 1)
