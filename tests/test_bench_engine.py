"""`strata-desk bench-engine` on the real engine (tiny model, CPU): the figures it prints and, with
`--rounds`, the medians of rounds run in turn with the peer's (a stand-in llama-bench)."""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path

import pytest

from engine import bench
from engine.loading import open_model

# A stand-in for llama.cpp's llama-bench: its JSON for one prompt and one generation run, a different
# speed each call (30, 10, 20 tok/s decode: the median is 20), counted in a file beside it.
FAKE_LLAMA_BENCH = '''#!{python}
import json, pathlib, sys
calls = pathlib.Path(__file__).with_suffix(".calls")
n = int(calls.read_text()) if calls.exists() else 0
calls.write_text(str(n + 1))
assert sys.argv[sys.argv.index("-r") + 1] == "1", sys.argv
decode = (30.0, 10.0, 20.0)[n % 3]
print(json.dumps([{{"n_prompt": 8, "n_gen": 0, "avg_ts": 10 * decode, "build_commit": "fake", "backends": "CPU"}},
                  {{"n_prompt": 0, "n_gen": 4, "avg_ts": decode, "build_commit": "fake", "backends": "CPU"}}]))
'''


def test_rounds_print_medians_beside_the_peer(tiny_model_q8: Path, tmp_path: Path, capsys) -> None:
    peer = tmp_path / "llama-bench"
    peer.write_text(FAKE_LLAMA_BENCH.format(python=sys.executable))
    peer.chmod(0o755)
    args = ["--model", str(tiny_model_q8), "--device", "cpu", "--prompt", "8", "--decode", "4", "--slots", "2",
            "--context", "64", "--rounds", "3", "--llama-bench", str(peer)]
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    assert int((tmp_path / "llama-bench.calls").read_text()) == 3
    decode = re.search(r"^decode +([\d.]+) tok/s \(median of 3 rounds, ([\d.]+)-([\d.]+)\)", out, re.M)
    assert decode, out
    ours, low, high = (float(v) for v in decode.groups())
    assert low <= ours <= high
    assert "decode 20.0 tok/s (median of 3 rounds, 10.0-30.0)" in out
    ratio = re.search(r"^ratio +prefill ([\d.]+)x, decode ([\d.]+)x llama.cpp \(medians of rounds run in turn\)", out, re.M)
    assert ratio and abs(float(ratio.group(2)) - ours / 20.0) <= 0.01
    assert re.search(r"^batch +[\d.]+ tok/s \(median of 3 rounds", out, re.M)


def test_a_failing_peer_leaves_our_figures_and_says_how(tiny_model_q8: Path, tmp_path: Path, capsys) -> None:
    """llama-bench killed by a signal (its repacked prompt path on one Xeon): our figures are printed, then what
    failed, and the command exits 1 after running the peer once; `--llama-bench-args` reach it."""
    peer = tmp_path / "llama-bench"
    peer.write_text(f"#!{sys.executable}\nimport os, pathlib, signal, sys\n"
                    "pathlib.Path(__file__).with_suffix('.args').write_text(' '.join(sys.argv[1:]))\n"
                    "os.kill(os.getpid(), signal.SIGSEGV)\n")
    peer.chmod(0o755)
    args = ["--model", str(tiny_model_q8), "--device", "cpu", "--prompt", "8", "--decode", "4", "--slots", "0",
            "--context", "64", "--rounds", "2", "--llama-bench", str(peer), "--llama-bench-args", "--repack 0"]
    assert bench.main(args) == 1
    out = capsys.readouterr().out
    assert re.search(r"^decode +[\d.]+ tok/s \(median of 2 rounds", out, re.M), out
    assert re.search(r"^llama.cpp +failed: .*llama-bench .* failed \(killed by SIGSEGV\)", out, re.M), out
    assert "--repack 0" in (tmp_path / "llama-bench.args").read_text()
    assert "ratio" not in out


@pytest.mark.parametrize(("flag", "value", "error"), [
    ("--rounds", "0", "--rounds must be at least 1"),
    ("--prefill", "0", "--prefill: must be at least 1 token, got '0'"),
    ("--prefill", "auto:x", "--prefill: must be a number of tokens, auto or auto:MAX, got 'auto:x'"),
    ("--prefill", "512:auto", "--prefill: must be a number of tokens, auto or auto:MAX, got '512:auto'"),
])
def test_bad_counts_are_refused(tiny_model_q8: Path, capsys, flag: str, value: str, error: str) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.main(["--model", str(tiny_model_q8), flag, value])
    assert exc.value.code == 2
    assert error in capsys.readouterr().err


@pytest.mark.parametrize(("prefill", "prompt", "context", "said", "rows"), [
    ("8", 100, 40, "20 tokens, chunks of 8", [8, 8, 4]),  # the prompt at most half the context
    ("auto", 600, 2048, "600 tokens, chunks of 512", [512, 88, 512, 88]),  # on the CPU auto is 512, no probe
])
def test_the_prompt_is_read_in_chunks_of_prefill(tiny_model_q8: Path, capsys, monkeypatch, prefill: str, prompt: int,
                                                 context: int, said: str, rows: list[int]) -> None:
    """`--prefill` as the engine's: the prompt read in forwards of that many rows (the warm-up read, then
    the timed one); `auto` says what it chose on its own line."""
    from engine.runner import Runner

    seen = []
    forward = Runner.forward
    monkeypatch.setattr(Runner, "forward", lambda self, spans, *a, **k: seen.append(sum(s.length for s in spans))
                        or forward(self, spans, *a, **k))
    args = ["--model", str(tiny_model_q8), "--device", "cpu", "--prompt", str(prompt), "--prefill", prefill,
            "--decode", "2", "--slots", "0", "--context", str(context)]
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    assert re.search(rf"^prefill +[\d.]+ tok/s \({said}\)", out, re.M), out
    assert ("chunk        --prefill auto:8192: chunks of 512 tokens (the CPU's choice)" in out) == (prefill == "auto")
    assert seen[:len(rows)] == rows


def test_profile_prints_windows_and_a_prompt_read(tiny_model_q8: Path, capsys, monkeypatch) -> None:
    """`--profile`: where a one-row and a batch window go, per window, and the prompt read again from the start
    (the read of the whole prompt runs as one chunk: its attention torch's fused prompt kernel, not a decode row's).
    Every name is listed: on a loaded machine one stalled call can push the others under the table's 0.5%."""
    monkeypatch.setattr(bench, "profile_table", functools.partial(bench.profile_table, least=0.0))
    args = ["--model", str(tiny_model_q8), "--device", "cpu", "--prompt", "24", "--decode", "4", "--slots", "2",
            "--context", "64", "--profile"]
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    for title in ("one row, per window:", "2 rows, per window:", "prompt (24 tokens):"):
        assert f"\n{title}\n" in out, out
    prompt = out.split("prompt (24 tokens):")[1]
    assert "aten::_scaled_dot_product" in prompt and "cpu attend_row" not in prompt
    # the C kernels' calls by name (`cpu.profiled`): the tiny model's Q8_0 products, norms and attention
    one_row = out.split("one row, per window:")[1].split("rows, per window:")[0]
    assert re.search(r"cpu Q8_0( packed)? \d+x\d+", one_row) and "cpu rms_norm" in one_row and "cpu attend_row" in one_row


def test_kernel_names_lose_their_templates_and_parameters() -> None:
    assert bench.kernel_name("_moe_matvec_kernel") == "_moe_matvec_kernel"
    assert bench.kernel_name("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float> >(at::native::"
                             "ReduceOp<float>)") == "at::native::reduce_kernel"
    assert bench.kernel_name("void pytorch_flash::flash_fwd_kernel<Traits<128>, false>(Flash_fwd_params)") == \
        "pytorch_flash::flash_fwd_kernel"
    assert bench.kernel_name("nvjet_sm90_tst_128x64_64x8_1x2_h_bz_TNT") == "nvjet_sm90_tst_128x64_64x8_1x2_h_bz_TNT"


def test_the_profiles_table_is_per_window_largest_first_with_the_rest_summed() -> None:
    """`profile_table`: each name's time and calls per window, its share of the total, the largest first down to
    0.5% of the total, the rest in one line that counts them."""
    times = [("small", 2.0, 6), ("moe", 600.0, 24), ("tiny", 1.0, 3), ("head", 300.0, 3), ("norm", 97.0, 30)]
    lines = bench.profile_table(times, 3, "kernels").splitlines()
    assert lines[0] == "333.3 us of kernels a window"
    assert [line.split()[-1] for line in lines[2:5]] == ["moe", "head", "norm"]
    assert lines[2].split()[:3] == ["200.0", "60.0%", "8.0"]
    assert lines[5].split() == ["1.0", "0.3%", "(2", "others)"]
    assert bench.profile_table([], 3, "kernels") == "no kernels timed"


@pytest.mark.parametrize("distinct", [False, True], ids=["copies", "distinct"])
def test_batch_rows_copy_the_session_or_read_prompts_of_their_own(tiny_model_q8: Path, capsys, distinct: bool) -> None:
    """By default the batch rows continue copies of the one-row session (routing its experts); with
    `--distinct` each reads a prompt of its own, as different conversations do."""
    _, model = open_model(str(tiny_model_q8), "cpu", None, 3, 64, max_chunk=16)
    figures = bench.run(model, model.device, 8, 4, 3, 16, warmup=1, distinct=distinct)
    prompts = [tuple(row.session.tokens[:8]) for row in figures.batch_rows]
    solo = tuple(figures.runner.solo.tokens[:8])
    assert len(prompts) == 3
    assert (len({solo, *prompts}) == 4) if distinct else (set(prompts) == {solo})
    # the distinct experts a layer the rows routed, counted: copies route one row's, different prompts more
    used, experts = model.hyper.experts_used, model.hyper.experts
    assert figures.batch_experts == used if not distinct else used < figures.batch_experts <= min(experts, 3 * used)
    args = ["--model", str(tiny_model_q8), "--device", "cpu", "--prompt", "8", "--decode", "4", "--slots", "2",
            "--context", "64"] + (["--distinct"] if distinct else [])
    assert bench.main(args) == 0
    label = "different prompts" if distinct else "copies of the one-row session"
    out = capsys.readouterr().out
    assert re.search(rf"^batch .* aggregate over 2 rows, {label} \(", out, re.M)
    assert re.search(r"^batch bound  [\d.]+ tok/s for 2 rows reading [\d.]+ distinct experts a layer .*% of it$", out,
                     re.M), out
