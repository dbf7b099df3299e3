"""Exactness at real shapes on CUDA (marker `gpu`): the qwen3-30b-a3b preset, skewed router, every
`strata-desk check` scenario three times, greedy and sampled, bf16 and the Q4_K_M mix (the fused MoE
kernel over 16-bit values and over blocks)."""

import pytest
import restarts
import torch

from engine.check import Driver, compare, sample_prompts
from engine.scenarios import cases
from engine.tier import FIXED, AdaptPolicy, RoutingProfile, install_tier
from strata_desk.testmodel import write_test_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

RUNS = 3
SAMPLED = "temperature=0.8 top_p=0.95 seed=3"
CASES = cases([2, 4, 8], max_new=32)


@pytest.fixture(scope="module", params=["bf16", "q4_k_m"])
def model(request, tmp_path_factory):
    return write_test_model(tmp_path_factory.mktemp("q30") / f"q30-{request.param}.gguf", preset="qwen3-30b-a3b",
                            layers=4, dtype=request.param, router_skew=1.0)


@pytest.fixture(scope="module")
def driver(model):
    return Driver.load(str(model), slots=8, device="cuda", exact=True, prefill=16)


@pytest.mark.parametrize("keys", ["", SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("case", list(CASES))
def test_batch_equals_solo_run_after_run(driver, case, keys):
    with torch.inference_mode():
        failures = [f"run {run}: {f}" for run in range(RUNS) for f in CASES[case](driver, keys).failures]
    assert failures == []


@pytest.fixture(scope="module")
def whole_prompts(model):
    """Prompts read whole (`check`'s driver reads chunks of 16): long enough for the dequantized prompt paths."""
    return Driver.load(str(model), slots=4, device="cuda", exact=True, context=2048, prefill=2048)


@pytest.mark.parametrize("lo, hi", [(70, 200), (1100, 1300)], ids=["dense-dequantized", "experts-dequantized"])
def test_batch_equals_solo_with_prompts_read_whole(whole_prompts, lo, hi):
    """Prompts of 64 rows and more take their dense products dequantized first (`linear_gpu.DEQUANTIZED_ROWS`),
    of 1,024 and more their experts too (`experts_blocks.DEQUANTIZED_ROWS`): batch = solo, run after run."""
    prompts = sample_prompts(whole_prompts.model.hyper.vocab, 4, seed=lo, lo=lo, hi=hi)
    with torch.inference_mode():
        failures = [f"run {run}: {f}" for run in range(2) for f in compare(whole_prompts, prompts, 24)]
    assert failures == []


@pytest.fixture(scope="module")
def tier_driver(model):
    """Half the experts in VRAM slots, seeded from a profile and fixed, decode misses on the CPU (upstream's
    exact settings: --adapt-every 1000000 --pcie-frac 0); prompt chunks stream theirs over PCIe."""
    if "bf16" in model.name:
        pytest.skip("the GPU tier's slots hold blocks the kernels read: the Q4_K_M mix")
    d = Driver.load(str(model), slots=8, device="cuda", exact=True, prefill=16, host_experts=True)
    h = d.model.hyper
    profile = RoutingProfile("q30", [[(e * 37) % h.experts for e in range(h.experts)]] * h.layers)
    install_tier(d.model, h.layers * h.experts // 2, AdaptPolicy(every=FIXED), profile, pcie_frac=0.0)
    return d


@pytest.mark.parametrize("keys", ["", SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("case", list(CASES))
def test_batch_equals_solo_with_the_gpu_expert_tier(tier_driver, case, keys):
    with torch.inference_mode():
        failures = [f"run {run}: {f}" for run in range(2) for f in CASES[case](tier_driver, keys).failures]
    assert failures == []
    served = tier_driver.model.expert_stats()
    assert served.vram and served.cpu and served.pcie  # decode misses on the CPU, prompt chunks' over PCIe


@pytest.mark.parametrize("mode", ["default", "exact"])
def test_same_requests_same_tokens_across_restarts(model, mode):
    """Two engine processes, the same requests: the same tokens. In default mode only requests that run
    alone are compared: which rows share a window there depends on when each request arrives."""
    commands = restarts.TOGETHER if mode == "exact" else restarts.ALONE
    args = ("--device", "cuda") + (("--exact",) if mode == "exact" else ())
    assert restarts.streams(model, commands, "2", *args) == restarts.streams(model, commands, "1", *args)
