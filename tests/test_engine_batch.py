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

PENALTIES = "repeat_penalty=1.3 presence_penalty=0.5 frequency_penalty=0.5 repeat_last_n=12"


@pytest.fixture(scope="module")
def driver(tiny_model):
    torch.set_num_threads(1)  # the tiny model gains nothing from threads, and loses a lot on a busy CPU
    return Driver.load(str(tiny_model), slots=8, exact=True, prefill=16)


def solo_tokens(driver, ids, max_new, keys=""):
    driver.reset()
    return collect(driver.run([gen(ids, max_new, keys)])).solo[0]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_batch_equals_solo_greedy(driver, n):
    prompts = sample_prompts(driver.model.hyper.vocab, n, seed=n)
    assert compare(driver, prompts, max_new=24) == []


@pytest.mark.parametrize("n", [2, 4, 8])
def test_batch_equals_solo_sampled(driver, n):
    prompts = sample_prompts(driver.model.hyper.vocab, n, seed=100 + n)
    assert compare(driver, prompts, max_new=24, keys="temperature=0.9 top_p=0.95 top_k=40 seed=1234") == []


@pytest.mark.parametrize("keys", [PENALTIES, PENALTIES + " temperature=0.9 top_k=40 seed=77"], ids=["greedy", "sampled"])
def test_batch_equals_solo_with_penalties(driver, keys):
    prompts = sample_prompts(driver.model.hyper.vocab, 4, seed=200)
    assert compare(driver, prompts, max_new=24, keys=keys) == []


def test_batches_really_share_windows(driver):
    prompts = sample_prompts(driver.model.hyper.vocab, 4, seed=9)
    driver.reset()
    driver.run([bgen(i, p, 16) for i, p in enumerate(prompts)])
    stats = driver.server.stats
    assert stats.windows < stats.tokens  # several rows per window


def test_long_prompt_read_while_two_slots_decode(driver):
    vocab = driver.model.hyper.vocab
    a, b, long = sample_prompts(vocab, 2, seed=21) + sample_prompts(vocab, 1, seed=22, lo=200, hi=200)
    expected = [solo_tokens(driver, p, 32) for p in (a, b, long)]
    driver.reset()
    # the long admission arrives after the two slots have started decoding
    hooks = [(lambda line: line.startswith("BT 1"), [bgen(2, long, 32)])]
    lines = driver.run([bgen(0, a, 32), bgen(1, b, 32)], hooks)
    got = collect(lines).slots
    assert [got[0], got[1], got[2]] == expected
    # the slots decoded between the long prompt's chunks
    long_chunks = [i for i, ln in enumerate(lines) if ln.startswith("PP") and P.parse_reply(ln).total == len(long)]
    assert len(long_chunks) == len(long) // 16 + (len(long) % 16 > 0)
    assert any(ln.startswith("BT 0") for ln in lines[long_chunks[0] : long_chunks[-1]])


def test_read_that_gives_way_goes_on_from_its_slot(driver):
    vocab = driver.model.hyper.vocab
    long = sample_prompts(vocab, 1, seed=31, lo=120, hi=120)[0]
    short = sample_prompts(vocab, 1, seed=32, lo=10, hi=10)[0]
    expected_long, expected_short = solo_tokens(driver, long, 20), solo_tokens(driver, short, 20)
    driver.reset()
    # after the long read's second chunk the server asks it to give way
    hooks = [(lambda line: line.startswith("PP 32 120"), ["BYIELD 0"])]
    lines = driver.run([bgen(0, long, 20)], hooks)
    yielded = [P.parse_reply(ln) for ln in lines if ln.startswith("YIELDED")]
    assert yielded == [P.Yielded(0, 32)]
    done = P.parse_reply(lines[-2])
    assert (done.finish, done.generated, done.prompt_read) == ("cancel", 0, 32) and lines[-1] == "BADM 0 0"
    lines = driver.run([bgen(1, short, 20), bgen(0, long, 20)])
    assert "RESUME 32" in lines
    got = collect(lines).slots
    assert got[1] == expected_short and got[0] == expected_long


def test_solo_read_yields_into_a_free_slot(driver):
    vocab = driver.model.hyper.vocab
    long = sample_prompts(vocab, 1, seed=41, lo=100, hi=100)[0]
    expected = solo_tokens(driver, long, 12)
    driver.reset()
    lines = driver.run([gen(long, 12)], [(lambda line: line.startswith("PP 16 100"), ["BYIELD 3"])])
    assert "YIELDED 3 16" in lines
    got = collect(driver.run([bgen(3, long, 12)])).slots[3]
    assert got == expected


def test_next_turn_continues_from_its_slot(driver):
    vocab = driver.model.hyper.vocab
    turn1, other = sample_prompts(vocab, 2, seed=51)
    extra = sample_prompts(vocab, 1, seed=52, lo=6, hi=6)[0]
    # solo reference: the two turns one after the other on the solo path
    driver.reset()
    first = collect(driver.run([gen(turn1, 10)])).solo[0]
    turn2 = turn1 + first + extra  # the client kept the reply
    turn2_dropped = turn1 + extra  # the client dropped the reply (e.g. its thinking)
    ref2 = collect(driver.run([gen(turn2, 10)])).solo[0]
    driver.reset()
    collect(driver.run([gen(turn1, 10)]))
    ref2_dropped = collect(driver.run([gen(turn2_dropped, 10)])).solo[0]

    driver.reset()
    got1 = collect(driver.run([bgen(0, turn1, 10), bgen(1, other, 10)])).slots[0]
    assert got1 == first
    lines = driver.run([bgen(0, turn2, 10)])
    assert f"RESUME {len(turn1) + len(first) - 1}" in lines
    assert collect(lines).slots[0] == ref2
    # the same slot again, from the turn boundary, the reply dropped
    driver.reset()
    driver.run([bgen(0, turn1, 10), bgen(1, other, 10)])
    lines = driver.run([bgen(0, turn2_dropped, 10)])
    assert f"RESUME {len(turn1)}" in lines
    assert collect(lines).slots[0] == ref2_dropped


@pytest.mark.parametrize("keys", ["", PENALTIES], ids=["plain", "penalties"])
def test_stopped_in_slot_then_continued_on_the_solo_path(driver, keys):
    vocab = driver.model.hyper.vocab
    a, b = sample_prompts(vocab, 2, seed=61)
    expected = solo_tokens(driver, a, 30, keys)
    # stop slot 0 after its 8th slot token, then continue the request alone with GEN
    driver.reset()
    hooks = [(lambda line, n=[0]: line.startswith("BT 0") and (n.__setitem__(0, n[0] + 1) or n[0] == 8), ["BSTOP 0"])]
    lines = driver.run([bgen(0, a, 30, keys), bgen(1, b, 30)], hooks)
    part = collect(lines).slots[0]
    bdone = next(P.parse_reply(ln) for ln in lines if ln.startswith("BDONE 0"))
    assert bdone.finish == "cancel" and bdone.generated == len(part) - 1
    lines = driver.run([gen(a + part, 30 - len(part), keys)])
    assert f"RESUME {len(a) + len(part) - 1}" in lines
    rest = collect(lines).solo[0]
    assert part + rest == expected


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


@pytest.mark.parametrize("int16", [False, True], ids=["float", "int16"])
def test_quantized_batch_equals_solo_without_exact_mode(tiny_model_q8, int16):
    """On the CPU the block kernels compute each row on its own, so even windows that share every
    product give each row its solo tokens, with float or int16 activations."""
    from engine.kernels import cpu

    cpu.set_int16(int16)
    try:
        driver = Driver.load(str(tiny_model_q8), slots=4, exact=False, prefill=16)
        prompts = sample_prompts(driver.model.hyper.vocab, 4, seed=77)
        assert compare(driver, prompts, max_new=16) == []
    finally:
        cpu.set_int16(True)
