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
    cpu = Driver.load(str(tiny_model), slots=0, device="cpu")
    gpu = Driver.load(str(tiny_model), slots=0, device="cuda", dtype="f32")
    for ids in sample_prompts(cpu.model.hyper.vocab, 4, seed=3):
        from engine.layers import Span

        a = cpu.model.forward(torch.tensor(ids), [Span(0, 0, len(ids))])
        b = gpu.model.forward(torch.tensor(ids), [Span(0, 0, len(ids))]).cpu()
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
    from engine.layers import moe_swiglu, route

    torch.manual_seed(0)
    E, Fd, H, k = 16, 64, 128, 4
    w = [torch.randn(E, Fd, H) * 0.05, torch.randn(E, Fd, H) * 0.05, torch.randn(E, H, Fd) * 0.05]
    x = torch.randn(8, H)
    weights, ids = route(x, torch.randn(E, H), k, normalize=True)
    ref = moe_swiglu(x, weights, ids, *w)  # CPU float32: the loop path
    cuda = [t.cuda().bfloat16() for t in w]
    got = moe_swiglu(x.cuda().bfloat16(), weights.cuda(), ids.cuda(), *cuda).float().cpu()
    assert torch.allclose(got, ref, atol=3e-2, rtol=3e-2), (got - ref).abs().max()
