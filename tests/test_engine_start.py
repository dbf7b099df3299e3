"""What a CPU engine imports at start: not torch._dynamo (1.3 s and ~140 MiB of every start on the
2-core machine; `torch.nn.attention.bias`, for a CUDA prompt's causal mask, imports it)."""

from __future__ import annotations

import subprocess
import sys


def test_the_engine_does_not_import_dynamo_at_start():
    code = "import sys, engine.__main__, engine.models; sys.exit(int('torch._dynamo' in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
