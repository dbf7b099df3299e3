"""Exactness at real shapes on CUDA (marker `gpu`): the qwen3-30b-a3b preset, skewed router, every
`strata-desk check` scenario three times, greedy and sampled, bf16 (grouped GEMMs) and the Q4_K_M mix
(the fused MoE kernel over blocks)."""

import pytest
import torch

from engine.check import Driver
from engine.scenarios import cases
from strata_desk.testmodel import write_test_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

RUNS = 3
SAMPLED = "temperature=0.8 top_p=0.95 seed=3"
CASES = cases([2, 4, 8], max_new=32)


@pytest.fixture(scope="module", params=["bf16", "q4_k_m"])
def driver(request, tmp_path_factory):
    path = write_test_model(tmp_path_factory.mktemp("q30") / f"q30-{request.param}.gguf", preset="qwen3-30b-a3b",
                            layers=4, dtype=request.param, router_skew=1.0)
    return Driver.load(str(path), slots=8, device="cuda", exact=True, prefill=16)


@pytest.mark.parametrize("keys", ["", SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("case", list(CASES))
def test_batch_equals_solo_run_after_run(driver, case, keys):
    with torch.inference_mode():
        failures = [f"run {run}: {f}" for run in range(RUNS) for f in CASES[case](driver, keys).failures]
    assert failures == []
