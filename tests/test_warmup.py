"""The start's warm-up (engine/warmup.py) leaves no trace: every session empty, and the requests after it
decode the tokens a fresh engine decodes (the tiny test model on the CPU; on a GPU the engine runs it
before READY)."""

import pytest
import torch

from engine.check import Driver, bgen, collect, gen, sample_prompts
from engine.warmup import warm_up


@pytest.fixture(scope="module")
def driver(tiny_model):
    torch.set_num_threads(1)
    return Driver.load(str(tiny_model), slots=3, exact=False, prefill=16)


def test_requests_after_the_warm_up_decode_as_on_a_fresh_engine(driver):
    a, b, c = sample_prompts(driver.model.hyper.vocab, 3, seed=5, lo=20, hi=40)

    def replies(warm: bool) -> tuple[list, dict]:
        driver.reset()
        if warm:
            runner = driver.server.runner
            assert warm_up(runner) > 0
            assert all(s.tokens == [] and s.turn == 0 for s in runner.sessions)
        slots = collect(driver.run([bgen(0, b, 10), bgen(2, c, 10)])).slots
        return collect(driver.run([gen(a, 10)])).solo, slots

    fresh = replies(warm=False)
    assert len(fresh[0][0]) == 10 and sorted(fresh[1]) == [0, 2]
    assert replies(warm=True) == fresh
