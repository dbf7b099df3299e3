"""Shared fixtures: the generated test models and the demo model."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

# The tiny test model gains nothing from threads, and on a busy two-core machine torch's thread pool
# makes it many times slower; engine processes the tests start inherit this too.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Many tests give strata-desk a fresh home; the compiled kernels (a function of their sources only)
# are shared instead of compiled again (~12 s) under each of those homes.
os.environ.setdefault("STRATA_DESK_KERNELS", str(Path(platformdirs.user_cache_dir("strata-desk")) / "kernels"))

import pytest
import torch

from strata_desk.testmodel import write_test_model

# Triton reads TRITON_INTERPRET as each kernel is defined: without a GPU every kernel module must be
# defined interpreted, whichever test module (collected in any order) imports it first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """`-n auto` (pyproject.toml's addopts): xdist's worker a core, but on a CUDA machine at most 4 a GPU, so
    that the GPU tests' processes (a CUDA context and test models each) fit a small card."""
    if not torch.cuda.is_available():
        return None
    return min(os.cpu_count() or 1, 4 * torch.cuda.device_count())


@pytest.fixture(autouse=True)
def seeded_torch() -> None:
    """Every test draws the same random numbers whichever tests ran before it (the order differs
    between a full run, `-k` and CI), so a failure seen once is seen again."""
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random qwen3moe test model (f32), written once per session."""
    return write_test_model(tmp_path_factory.mktemp("models") / "tiny-f32.gguf", preset="tiny", dtype="f32")


@pytest.fixture(scope="session")
def tiny_model_q8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same model with its large tensors in Q8_0."""
    return write_test_model(tmp_path_factory.mktemp("models") / "tiny-q8_0.gguf", preset="tiny", dtype="q8_0")


@pytest.fixture(scope="session")
def demo_model() -> Path:
    """The Gemma 3 270M demo GGUF; skips when the demo package is not installed."""
    from strata_desk.demo import DemoModelMissing, demo_model_path

    try:
        return demo_model_path()
    except DemoModelMissing as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def chat_model() -> Path:
    """SmolLM2-135M-Instruct (the `--demo chat` model) through the demo's own fetch: downloaded once
    into the cache dir, reused by every later test and run; skips when it cannot be downloaded."""
    from strata_desk.demo import DemoModelMissing, chat_model_path

    try:
        return chat_model_path()
    except DemoModelMissing as exc:
        pytest.skip(str(exc))
