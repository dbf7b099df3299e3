"""The engine on CUDA (marker `gpu`; skipped without a GPU): same answers as the CPU, batch = solo."""

import subprocess
import sys

import pytest
import torch

from engine.check import Driver, collect, compare, gen, sample_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def greedy(driver, ids, n=16):
    driver.reset()
    return collect(driver.run([gen(ids, n)])).solo[0]


def test_cuda_f32_matches_cpu_f32(tiny_model):
    cpu = Driver.load(str(tiny_model), slots=0, device="cpu", kv="f32")  # the CPU's default KV is fp16
    gpu = Driver.load(str(tiny_model), slots=0, device="cuda", dtype="f32")
    for ids in sample_prompts(cpu.model.hyper.vocab, 4, seed=3):
        from engine.batch import Span

        a = cpu.server.runner.forward([Span(0, 0, len(ids))], ids)
        b = gpu.server.runner.forward([Span(0, 0, len(ids))], ids).cpu()
        assert torch.allclose(a, b, atol=2e-3, rtol=1e-3), (a - b).abs().max()
        assert greedy(cpu, ids)[:8] == greedy(gpu, ids)[:8]


def test_cuda_bf16_batch_equals_solo(tiny_model):
    driver = Driver.load(str(tiny_model), slots=8, device="cuda")
    prompts = sample_prompts(driver.model.hyper.vocab, 8, seed=5)
    assert compare(driver, prompts, max_new=24) == []


def test_cuda_serve_process(tiny_model):
    out = subprocess.run([sys.executable, "-m", "engine", "--serve", "--device", "cuda", "--model", str(tiny_model)],
                         input="GEN 16 1,2,3\nQUIT\n", capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "device=cuda" in out.stdout and "dtype=bfloat16" in out.stdout
    assert "READY" in out.stdout and "DONE" in out.stdout


def test_grouped_experts_match_the_per_expert_loop():
    from engine.experts import ResidentExperts, route
    from engine.weights import LinearStack

    def experts(tensors, device):
        return ResidentExperts(*(LinearStack.of_dense(t) for t in tensors), torch.device(device))

    torch.manual_seed(0)
    E, Fd, H, k = 16, 64, 128, 4
    w = [torch.randn(E, Fd, H) * 0.05, torch.randn(E, Fd, H) * 0.05, torch.randn(E, H, Fd) * 0.05]
    for rows in (1, 8):
        x = torch.randn(rows, H)
        weights, ids = route(x, torch.randn(E, H), k, normalize=True)
        ref = experts(w, "cpu")(x, weights, ids)  # CPU float32: the per-expert path
        gpu = experts([t.cuda().bfloat16() for t in w], "cuda")
        assert gpu.grouped
        got = gpu(x.cuda().bfloat16(), weights.cuda(), ids.cuda()).float().cpu()
        assert torch.allclose(got, ref, atol=3e-2, rtol=3e-2), (got - ref).abs().max()
