"""Repetition penalties (llama.cpp's repeat/presence/frequency over the last repeat_last_n tokens):
the arithmetic against a plain loop, and the engine's greedy tokens against transformers' logits
penalized step by step. Batch = solo with penalties is in test_engine_batch.py."""

from collections import Counter

import pytest
import torch
from reference import reference_logits

from engine import protocol as P
from engine.check import Driver, collect, gen
from engine.sampling import Draw, penalize, sample_rows
from engine.tokenizer import Tokenizer

PENALTIES = P.Sampling(repeat_penalty=1.5, presence_penalty=0.6, frequency_penalty=0.4, repeat_last_n=8)


def reference_penalty(logits: list[float], s: P.Sampling, context: list[int]) -> list[float]:
    """llama.cpp's llama_sampler_penalties_apply, one row, in plain Python."""
    out = list(logits)
    window = context if s.repeat_last_n < 0 else context[-s.repeat_last_n:] if s.repeat_last_n else []
    for token, count in Counter(window).items():
        x = out[token]
        x = x * s.repeat_penalty if x <= 0 else x / s.repeat_penalty
        out[token] = x - (count * s.frequency_penalty + s.presence_penalty)
    return out


def test_penalty_window():
    ctx = [1, 2, 3, 4, 5]
    assert P.Sampling().penalty_window(ctx) == []  # no penalties, nothing counted
    assert P.Sampling(repeat_penalty=1.1, repeat_last_n=3).penalty_window(ctx) == [3, 4, 5]
    assert P.Sampling(presence_penalty=0.5, repeat_last_n=-1).penalty_window(ctx) == ctx
    assert P.Sampling(frequency_penalty=0.5, repeat_last_n=0).penalty_window(ctx) == []
    assert not P.Sampling(repeat_last_n=-1).penalized


def test_penalize_is_llama_cpp_arithmetic_per_row():
    gen_ = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 40, generator=gen_) * 3
    before = logits.clone()
    contexts = [[1, 2, 2, 3], [5, 5, 5, 7, 9, 1, 0, 39, 5, 12], [4, 4]]
    samplings = [P.Sampling(), PENALTIES, P.Sampling(repeat_penalty=0.8, frequency_penalty=-1, repeat_last_n=-1)]
    draws = [Draw.after(s, 1, c) for s, c in zip(samplings, contexts, strict=True)]
    out = penalize(logits, draws)
    assert torch.equal(logits, before)  # the caller's logits are left alone
    for row, (s, c) in enumerate(zip(samplings, contexts, strict=True)):
        want = torch.tensor(reference_penalty(logits[row].tolist(), s, c))
        assert torch.allclose(out[row], want, atol=1e-5), row
        alone = penalize(logits[row : row + 1], draws[row : row + 1])[0]
        assert torch.equal(alone, out[row])  # a row's result does not depend on the others
    assert penalize(logits, [Draw.after(P.Sampling(), 1, [1, 2])] * 3) is logits


def test_penalties_decide_greedy_and_sampled_rows():
    logits = torch.tensor([[5.0, 4.9, 0.0, -1.0]] * 2)
    rows = [Draw.after(P.Sampling(presence_penalty=0.5), 1, [0]),
            Draw.after(P.Sampling(temperature=0.01, presence_penalty=0.5, seed=3), 3, [0])]
    assert sample_rows(logits, rows) == [1, 1]
    assert sample_rows(logits[:1], [Draw.after(P.Sampling(), 1, [0])]) == [0]


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model, Driver.load(str(tiny_model), slots=0, kv="f32")


@pytest.mark.parametrize("sampling", [PENALTIES, P.Sampling(repeat_penalty=1.3, repeat_last_n=-1),
                                      P.Sampling(presence_penalty=1.5, frequency_penalty=0.5, repeat_last_n=16)],
                         ids=["all-three-last-8", "repeat-whole-context", "presence-frequency-last-16"])
def test_greedy_with_penalties_token_by_token_against_transformers(tiny, sampling):
    path, driver = tiny
    ids = Tokenizer.from_gguf(path).encode("the the the the cat sat on the the mat")
    keys = " ".join(sampling.to_keys())
    driver.reset()
    plain = collect(driver.run([gen(ids, 24)])).solo[0]
    driver.reset()
    tokens = collect(driver.run([gen(ids, 24, keys)])).solo[0]
    assert tokens != plain  # the penalties changed the reply
    ref = reference_logits(path, ids + tokens)
    for i, token in enumerate(tokens):
        context = ids + tokens[:i]
        penalized = reference_penalty(ref[len(context) - 1].tolist(), sampling, context)
        assert max(range(len(penalized)), key=penalized.__getitem__) == token, f"token {i}"
