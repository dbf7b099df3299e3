"""`--prefill N|auto|auto:MAX`: parsing, the largest chunk that fits, and the engine's choice (a GPU test
measures the probe read on CUDA)."""

import subprocess
import sys

import pytest
import torch

from engine import protocol as P
from engine.prefill import PROBE, PrefillAsk, candidates, choose_prefill, parse_prefill

MIB = 1 << 20


@pytest.mark.parametrize(("text", "ask"), [("512", PrefillAsk(512)), ("auto", PrefillAsk(P.PREFILL_AUTO_MAX, True)),
                                           ("auto:16384", PrefillAsk(16384, True))])
def test_prefill_parses(text: str, ask: PrefillAsk) -> None:
    assert parse_prefill(text) == ask
    assert str(ask) == (text if text != "auto" else "auto:8192")


@pytest.mark.parametrize("text", ["", "0", "-4", "auto:", "auto:0", "auto:big", "512:auto", "Auto", "4k"])
def test_bad_prefill_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="--prefill must be"):
        parse_prefill(text)


def test_auto_tries_powers_of_two_largest_first() -> None:
    assert candidates(8192) == [8192, 4096, 2048, 1024, 512]
    assert candidates(3000) == [2048, 1024, 512]  # up to the most asked (or the context)
    assert candidates(512) == [512] and candidates(100) == [100]  # a context below PROBE


def test_auto_is_512_on_the_cpu_and_sizes_for_it() -> None:
    ask = parse_prefill("auto")
    assert ask.most(torch.device("cpu")) == PROBE
    assert ask.most(torch.device("cuda")) == P.PREFILL_AUTO_MAX
    assert PrefillAsk(2048).most(torch.device("cpu")) == 2048


def test_the_engine_says_the_chunk_it_reads(tiny_model) -> None:
    out = subprocess.run([sys.executable, "-m", "engine", "--serve", "--threads", "1", "--model", str(tiny_model),
                          "--device", "cpu", "--prefill", "auto"], input="QUIT\n", capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    info = P.parse_reply(out.stdout.splitlines()[0])
    assert isinstance(info, P.Info) and info.values["prefill"] == PROBE
    assert "--prefill auto:8192: chunks of 512 tokens (the CPU's choice)" in out.stderr
    bad = subprocess.run([sys.executable, "-m", "engine", "--serve", "--model", str(tiny_model), "--prefill", "x"],
                         input="", capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--prefill: must be a number of tokens, auto or auto:MAX, got 'x'" in bad.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_measures_chunks_on_the_gpu(tiny_model, monkeypatch) -> None:
    """On CUDA `auto` reads the largest chunk at the end of the context to measure its peak, then leaves
    the solo session empty; with no VRAM free it tries every size and settles on 512, saying so."""
    from engine import prefill
    from engine.loading import open_model
    from engine.runner import Runner

    _, model = open_model(str(tiny_model), "cuda", None, 0, 8192, max_chunk=P.PREFILL_AUTO_MAX)
    runner = Runner(model, 0, exact=False, graphs=False)
    chunk, why = choose_prefill(runner, parse_prefill("auto"))
    assert chunk == candidates(min(P.PREFILL_AUTO_MAX, model.context))[0] > PROBE
    assert "MiB at the peak of one at the end of the context" in why, why
    assert runner.solo.tokens == []
    small, large = prefill.read_peak(runner, 512), prefill.read_peak(runner, 2048)
    assert 0 < small < large < 256 * MIB  # a tiny model's chunks
    monkeypatch.setattr(prefill, "free_bytes", lambda device: (0, 0))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    chunk, why = choose_prefill(runner, parse_prefill("auto:4096"))
    assert chunk == PROBE and "a long prompt may run out of memory" in why and why.count(" MiB") >= 3


def test_the_server_config_takes_auto_or_a_chunk() -> None:
    from server.config import ConfigError, validate_config

    config = validate_config({"model": "m.gguf", "prefill": "auto"})
    line = config.engine_command_line()
    assert line[line.index("--prefill") + 1] == "auto" and config.prefill_most == P.PREFILL_AUTO_MAX
    assert validate_config({"model": "m.gguf", "prefill": 1024}).prefill_most == 1024
    for bad in (8, "auto:4096", "big"):
        with pytest.raises(ConfigError, match="prefill"):
            validate_config({"model": "m.gguf", "prefill": bad})
