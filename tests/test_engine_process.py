"""The engine as a process: start-up lines, the solo path, errors that keep it serving, refusals."""

import subprocess
import sys
import time

import pytest
import restarts

from engine import protocol as P


def run_engine(model, script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "engine", "--serve", "--threads", "1", "--model", str(model), *args],
        input=script, capture_output=True, text=True, timeout=timeout,
    )


def replies(stdout: str) -> list:
    return [P.parse_reply(line) for line in stdout.splitlines() if not line.startswith("STATS")]


def test_gen_prints_ready_tokens_and_done(tiny_model):
    out = run_engine(tiny_model, "GEN 16 1,2,3\nQUIT\n")
    assert out.returncode == 0, out.stderr
    r = replies(out.stdout)
    assert isinstance(r[0], P.Info) and r[0].values["arch"] == "qwen3moe"
    ready = next(x for x in r if isinstance(x, P.Ready))
    assert ready.stop and ready.context > 0
    tokens = [x for x in r if isinstance(x, P.Token)]
    done = [x for x in r if isinstance(x, P.Done)]
    assert len(done) == 1 and done[0].generated == len(tokens)
    assert done[0].finish in ("length", "stop")
    if done[0].finish == "length":
        assert len(tokens) == 16
    assert done[0].prompt_tokens == 3


def test_errors_keep_the_engine_serving(tiny_model):
    script = "\n".join([
        "HELLO",
        "GEN 4 1,x",
        "GEN 4 temperature=-1 1",
        "GEN 100000 1,2",  # beyond the context
        "GEN 2 99999999",  # outside the vocabulary
        "BGEN 0 4 1,2",  # no slots without --batch
        "GEN 2 1,2",
        "QUIT",
    ]) + "\n"
    out = run_engine(tiny_model, script, "--max-context", "512")
    assert out.returncode == 0
    r = replies(out.stdout)
    errs = [x.message for x in r if isinstance(x, P.Err)]
    assert len(errs) == 6, errs
    assert "unknown command" in errs[0]
    assert "exceeds the context (512)" in errs[3]
    assert "outside the vocabulary" in errs[4]
    assert "--batch" in errs[5]
    assert sum(isinstance(x, P.Done) for x in r) == 1


def test_sampled_tokens_depend_only_on_seed(tiny_model):
    script = "GEN 12 temperature=1.0 seed=11 5,6,7\nGEN 12 temperature=1.0 seed=11 5,6,7\nGEN 12 temperature=1.0 seed=12 5,6,7\nQUIT\n"
    r = replies(run_engine(tiny_model, script).stdout)
    runs, cur = [], []
    for x in r:
        if isinstance(x, P.Token):
            cur.append(x.id)
        elif isinstance(x, P.Done):
            runs.append(cur)
            cur = []
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_follow_up_turn_reuses_the_live_session(tiny_model):
    prompt = list(range(1, 200))
    follow = prompt + [7, 8, 9]
    script = f"GEN 2 {','.join(map(str, prompt))}\nGEN 2 {','.join(map(str, follow))}\nQUIT\n"
    r = replies(run_engine(tiny_model, script, "--prefill", "64").stdout)
    resumes = [x for x in r if isinstance(x, P.Resume)]
    done = [x for x in r if isinstance(x, P.Done)]
    assert [x.reused for x in resumes] == [len(prompt)]
    assert done[1].reused == len(prompt)
    reads = [x for x in r if isinstance(x, P.Progress)]
    assert [p.read for p in reads] == [64, 128, 192, 199, 202]


def test_stop_ends_a_running_request(tiny_model):
    proc = subprocess.Popen([sys.executable, "-m", "engine", "--serve", "--threads", "1", "--model", str(tiny_model)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        proc.stdin.write("GEN 3000 1,2,3\n")
        proc.stdin.flush()
        seen = 0
        for line in proc.stdout:
            if line.startswith("T "):
                seen += 1
                if seen == 5:
                    proc.stdin.write("STOP\n")
                    proc.stdin.flush()
            if line.startswith("DONE"):
                done = P.parse_reply(line)
                break
        assert done.finish == "cancel" and 5 <= done.generated < 3000
        proc.stdin.write("QUIT\n")
        proc.stdin.flush()
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"not a gguf at all", "not a GGUF file"),
        (b"GGUF\x03\x00\x00\x00\x05", "truncated"),
    ],
)
def test_refuses_bad_files(tmp_path, content, message):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    out = run_engine(bad, "QUIT\n")
    assert out.returncode == 1
    assert out.stdout.startswith("ERR cannot load model") and message in out.stdout


def test_refuses_a_truncated_model(tiny_model, tmp_path):
    data = tiny_model.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    out = run_engine(cut, "QUIT\n")
    assert out.returncode == 1 and "truncated" in out.stdout


def test_refuses_an_unknown_architecture(tiny_model, tmp_path):
    data = tiny_model.read_bytes()
    other = tmp_path / "other.gguf"
    other.write_bytes(data.replace(b"qwen3moe", b"qwen9moe"))
    out = run_engine(other, "QUIT\n")
    assert out.returncode == 1 and "architecture 'qwen9moe' is not supported" in out.stdout


def test_end_of_input_finishes_work_then_exits(tiny_model):
    t0 = time.perf_counter()
    out = run_engine(tiny_model, "GEN 4 1,2,3\n")
    assert out.returncode == 0 and "DONE 4" in out.stdout
    assert time.perf_counter() - t0 < 60


@pytest.mark.parametrize("mode", [(), ("--exact",)], ids=["default", "exact"])
def test_same_requests_same_tokens_across_restarts(tiny_model_q8, mode):
    """Run to run: two engine processes (2 threads, different hash seeds) give the same tokens for the same
    requests, greedy and sampled, on the solo path and in slots (on the CPU the block kernels make even
    default mode's shared windows row-invariant)."""
    first = restarts.streams(tiny_model_q8, restarts.TOGETHER, "1", "--threads", "2", *mode)
    assert restarts.streams(tiny_model_q8, restarts.TOGETHER, "2", "--threads", "2", *mode) == first
