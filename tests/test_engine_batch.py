"""Batch slots, token by token against solo runs (exact mode, the tiny test model on CPU).

The seed's batch_test and batch_interleave_test as pytest: N prompts alone then together (greedy,
sampled, with penalties); a long prompt read while slots decode; a read that gives way (BYIELD) and
goes on; a next turn continued from its slot; a request stopped in its slot and continued on the
solo path.
"""

import pytest
import torch

from engine import protocol as P
from engine.batch import Span
from engine.check import Driver, bgen, collect, compare, gen, sample_prompts
from engine.scenarios import cases, give_way, long_read, next_turn, slots_n, solo, stop_solo

PENALTIES = "repeat_penalty=1.3 presence_penalty=0.5 frequency_penalty=0.5 repeat_last_n=12"
SAMPLED = "temperature=0.9 top_p=0.95 top_k=40 seed=1234"


@pytest.fixture(scope="module")
def driver(tiny_model):
    torch.set_num_threads(1)  # the tiny model gains nothing from threads, and loses a lot on a busy CPU
    return Driver.load(str(tiny_model), slots=8, exact=True, prefill=16)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_batch_equals_solo_greedy(driver, n):
    assert slots_n(driver, n=n, seed=n).failures == []


@pytest.mark.parametrize("n", [2, 4, 8])
def test_batch_equals_solo_sampled(driver, n):
    assert slots_n(driver, SAMPLED, n=n, seed=100 + n).failures == []


@pytest.mark.parametrize("keys", [PENALTIES, PENALTIES + " temperature=0.9 top_k=40 seed=77"], ids=["greedy", "sampled"])
def test_batch_equals_solo_with_penalties(driver, keys):
    assert slots_n(driver, keys, n=4, seed=200).failures == []


def test_batches_really_share_windows(driver):
    prompts = sample_prompts(driver.model.hyper.vocab, 4, seed=9)
    driver.reset()
    driver.run([bgen(i, p, 16) for i, p in enumerate(prompts)])
    stats = driver.server.stats
    assert stats.windows < stats.tokens  # several rows per window


@pytest.mark.parametrize("keys", ["", SAMPLED], ids=["greedy", "sampled"])
def test_long_prompt_read_while_two_slots_decode(driver, keys):
    r = long_read(driver, keys, length=200)
    assert r.failures == []
    # the slots decoded between the long prompt's chunks
    long_chunks = [i for i, ln in enumerate(r.lines) if ln.startswith("PP") and P.parse_reply(ln).total == 200]
    assert len(long_chunks) == 200 // 16 + 1
    assert any(ln.startswith("BT 0") for ln in r.lines[long_chunks[0] : long_chunks[-1]])


@pytest.mark.parametrize("keys", ["", SAMPLED], ids=["greedy", "sampled"])
def test_read_that_gives_way_goes_on_from_its_slot(driver, keys):
    r = give_way(driver, keys, length=120)
    assert r.failures == []
    assert [ln for ln in r.lines if ln.startswith("YIELDED")] == ["YIELDED 0 32"]
    given_way = r.lines.index("YIELDED 0 32")
    done = P.parse_reply(r.lines[given_way + 1])
    assert (done.finish, done.generated, done.prompt_read) == ("cancel", 0, 32) and r.lines[given_way + 2] == "BADM 0 0"
    assert "RESUME 32" in r.lines


def test_solo_read_yields_into_a_free_slot(driver):
    vocab = driver.model.hyper.vocab
    long = sample_prompts(vocab, 1, seed=41, lo=100, hi=100)[0]
    expected = solo(driver, long, 12)
    driver.reset()
    lines = driver.run([gen(long, 12)], [(lambda line: line.startswith("PP 16 100"), ["BYIELD 3"])])
    assert "YIELDED 3 16" in lines
    got = collect(driver.run([bgen(3, long, 12)])).slots[3]
    assert got == expected


@pytest.mark.parametrize("keys", ["", SAMPLED], ids=["greedy", "sampled"])
def test_next_turn_continues_from_its_slot(driver, keys):
    r = next_turn(driver, keys, seed=51, max_new=10)
    assert r.failures == []
    turn1 = sample_prompts(driver.model.hyper.vocab, 2, seed=51)[0]
    first = solo(driver, turn1, 10, keys)
    resumed = [ln for ln in r.lines if ln.startswith("RESUME")]
    # from the end of the reply when the client kept it, from the turn boundary when it dropped it
    assert resumed == [f"RESUME {len(turn1) + len(first) - 1}", f"RESUME {len(turn1)}"]


@pytest.mark.parametrize("keys", ["", PENALTIES, SAMPLED], ids=["plain", "penalties", "sampled"])
def test_stopped_in_slot_then_continued_on_the_solo_path(driver, keys):
    r = stop_solo(driver, keys, after=8)
    assert r.failures == []
    bdone = next(P.parse_reply(ln) for ln in r.lines if ln.startswith("BDONE 0"))
    assert bdone.finish == "cancel" and bdone.generated == len(collect(r.lines).slots[0]) - 1
    assert any(ln.startswith("RESUME") for ln in r.lines)


def test_bad_batch_commands(driver):
    driver.reset()
    lines = driver.run(["BGEN 9 4 1,2", "BGEN 0 4 1,2", "BGEN 0 4 3,4"])
    errs = [ln for ln in lines if ln.startswith("ERR")]
    assert errs == ["ERR slot 9 does not exist (0..7)", "ERR slot 0 is busy"]


def test_default_mode_window_agrees_with_rows_alone(driver):
    """Without --exact the rows share each product (and one attention call): equal within rounding."""
    prompts = sample_prompts(driver.model.hyper.vocab, 4, seed=71)
    driver.reset()
    lines = driver.run([bgen(i, p, 1) for i, p in enumerate(prompts)])
    firsts = collect(lines).slots
    spans = [Span(i, len(p), 1) for i, p in enumerate(prompts)]
    tokens = [firsts[i][0] for i in range(4)]
    runner = driver.server.runner
    together = runner.forward(spans, tokens)
    alone = torch.cat([runner.forward([spans[i]], tokens[i : i + 1]) for i in range(4)])
    assert torch.allclose(together, alone, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("activations", ["float", "int16", "int8"])
def test_quantized_batch_equals_solo_without_exact_mode(tiny_model_q8, activations):
    """On the CPU the block kernels compute each row on its own, so even windows that share every
    product give each row its solo tokens, with float, int16 or int8 activations."""
    from engine.kernels import cpu

    cpu.set_activations(activations)
    try:
        driver = Driver.load(str(tiny_model_q8), slots=4, exact=False, prefill=16)
        prompts = sample_prompts(driver.model.hyper.vocab, 4, seed=77)
        assert compare(driver, prompts, max_new=16) == []
    finally:
        cpu.set_activations("int16")


Q8_0_KV_CASES = cases([2, 4], max_new=16)


@pytest.fixture(scope="module")
def driver_q8_0_kv(tmp_path_factory):
    """Two layers of the `demo-moe` preset: heads of 64 values, two Q8_0 blocks a row (the tiny model's
    heads of 16 are refused, as llama.cpp refuses them: below)."""
    from strata_desk.testmodel import write_test_model

    path = write_test_model(tmp_path_factory.mktemp("models") / "moe-q8_0.gguf", preset="demo-moe", layers=2,
                            dtype="q8_0")
    return Driver.load(str(path), slots=4, exact=True, prefill=16, kv="q8_0")


def test_a_q8_0_kv_cache_refuses_heads_of_16_values(tiny_model):
    with pytest.raises(ValueError, match="multiple of 32, got 16"):
        Driver.load(str(tiny_model), slots=2, kv="q8_0")


@pytest.mark.parametrize("case", list(Q8_0_KV_CASES))
def test_batch_equals_solo_with_a_q8_0_kv_cache(driver_q8_0_kv, case):
    """`--kv q8_0`: the prompt chunks' rows quantized by torch and the decode rows by the C kernel, the
    same bits (tests/test_cpu_ops.py); every scenario's batch tokens equal solo."""
    assert driver_q8_0_kv.model.kv.k[0].dtype == torch.uint8
    assert Q8_0_KV_CASES[case](driver_q8_0_kv, "").failures == []
