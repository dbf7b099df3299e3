"""Our engine against an independent reference: transformers loading the same GGUF in float32.

For each prompt our engine reads the prompt and decodes greedily; the reference then scores
prompt + our continuation in one forward pass. Logits must agree within a tight tolerance at every
position, and the reference's argmax at every position must be the token we chose: that is the
greedy continuation being equal, token by token.
"""

import pytest
import torch
from reference import reference_logits

from engine.batch import Span
from engine.check import Driver
from engine.kernels import cpu
from engine.tokenizer import Tokenizer

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Water boils at a temperature of",
]


def our_logits(driver: Driver, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy continuation of `ids` and the logits that chose each token, [n, vocab]."""
    runner, rows = driver.server.runner, []
    logits = runner.forward([Span(0, 0, len(ids))], ids)[0]
    out, pos = [], len(ids)
    for _ in range(n):
        rows.append(logits)
        out.append(int(logits.argmax()))
        logits = runner.forward([Span(0, pos, 1)], [out[-1]])[0]
        pos += 1
    return out, torch.stack(rows)


def check(path, driver, prompt: str, n: int, atol: float, activations: str = "float", greedy: bool = True):
    """Float32 activations in the CPU kernels (the reference's arithmetic) unless told ("int16": the
    engine's default); with `greedy`, our greedy tokens must be the reference's too."""
    ids = Tokenizer.from_gguf(path).encode(prompt)
    cpu.set_activations(activations)
    try:
        tokens, ours = our_logits(driver, ids, n)
    finally:
        cpu.set_activations("int16")
    ref = reference_logits(path, ids + tokens)[len(ids) - 1 : len(ids) - 1 + n]
    assert ours.shape == ref.shape
    err = (ours - ref).abs().max().item()
    assert err < atol, f"max logit difference {err} for {prompt!r}"
    assert not greedy or ref.argmax(-1).tolist() == tokens, f"greedy continuation differs for {prompt!r}"
    return tokens


# Tolerances, from measured differences (max |logit - reference| over 16 greedy steps): with a
# float32 KV and float32 activations the CPU kernels (exactly dequantized blocks, float32 dot
# products) are the reference's arithmetic: <= 1e-4 on the demo (Q5_0/Q8_0/Q4_K/Q6_K) and the tiny
# models, so 1e-3. The default int16 activations (the head's too) move them by up to 0.0089 on the demo and 0.0024 on
# the tiny Q8_0 model, so 1e-2; the default fp16 KV by up to 0.023 on the demo and 0.015 on the tiny
# model, so 3e-2 for the defaults together (a bf16 KV would move them by up to 0.11; llama.cpp's
# int8 activations, opt-in here, by up to 1.96 on the demo). Greedy tokens are equal in every case but int8.


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model, Driver.load(str(tiny_model), slots=0, kv="f32")


@pytest.fixture(scope="module")
def tiny_q8(tiny_model_q8):
    return tiny_model_q8, Driver.load(str(tiny_model_q8), slots=0, kv="f32")


@pytest.mark.parametrize("prompt", PROMPTS)
def test_tiny_matches_reference(tiny, prompt):
    path, driver = tiny
    check(path, driver, prompt, 16, atol=1e-3)


def test_tiny_with_default_fp16_kv_matches_reference(tiny_model):
    driver = Driver.load(str(tiny_model), slots=0)
    assert driver.model.kv.k[0].dtype == torch.float16
    check(tiny_model, driver, PROMPTS[1], 16, atol=3e-2, activations="int16")


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_tiny_q8_0_matches_reference(tiny_q8, prompt):
    path, driver = tiny_q8
    check(path, driver, prompt, 16, atol=1e-3)


def test_tiny_q8_0_with_int16_activations_matches_reference(tiny_q8):
    path, driver = tiny_q8
    check(path, driver, PROMPTS[3], 16, atol=1e-2, activations="int16")


@pytest.fixture(scope="module")
def demo(demo_model):
    return demo_model, Driver.load(str(demo_model), slots=0, context=512, kv="f32")


@pytest.fixture(scope="module")
def demo_fp16_kv(demo_model):
    return demo_model, Driver.load(str(demo_model), slots=0, context=512)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_demo_matches_reference(demo, prompt):
    path, driver = demo
    check(path, driver, prompt, 16, atol=1e-3)


@pytest.mark.parametrize("prompt", PROMPTS[2:])
def test_demo_with_int16_activations_matches_reference(demo, prompt):
    path, driver = demo
    check(path, driver, prompt, 16, atol=1e-2, activations="int16")


def test_demo_with_int8_activations_stays_within_llama_cpp_rounding(demo):
    """int8 activations (llama.cpp's rounding, opt-in) move the demo's logits by up to 1.96 and change
    greedy replies within 16 tokens on 2 of the 4 prompts, as llama.cpp's own do; the logits (taken
    on our tokens) stay that close."""
    path, driver = demo
    check(path, driver, PROMPTS[2], 16, atol=2.5, activations="int8", greedy=False)


@pytest.mark.parametrize("prompt", PROMPTS[1:3])
def test_demo_with_the_defaults_matches_reference(demo_fp16_kv, prompt):
    path, driver = demo_fp16_kv
    check(path, driver, prompt, 16, atol=3e-2, activations="int16")


def test_demo_with_a_q8_0_kv_stays_within_its_rounding(demo_model):
    """`--kv q8_0` (llama.cpp's 8-bit KV blocks) moved the demo's logits by 0.30-0.71 over 16 greedy steps of
    the four prompts (f16: 0.008-0.022) and changed the greedy reply to one of them; the README's prompt
    keeps its reply."""
    driver = Driver.load(str(demo_model), slots=0, context=512, kv="q8_0")
    check(demo_model, driver, PROMPTS[0], 16, atol=1.0, activations="int16")


def test_demo_known_continuation(demo_fp16_kv):
    path, driver = demo_fp16_kv
    tokens = check(path, driver, PROMPTS[0], 16, atol=3e-2, activations="int16")
    # model-notes.md: " the capital of the country of France. It is the largest city in France and"
    assert tokens[:15] == [506, 5279, 529, 506, 2891, 529, 7001, 236761, 1030, 563, 506, 7488, 3207, 528, 7001]


# SmolLM2-135M-Instruct (`llama`, Q4_1 with a Q8_0 tied head): measured over the four prompts and 24
# greedy steps, float32 KV and activations <= 6e-5 from the reference, int16 activations <= 0.0059,
# the defaults (fp16 KV too) <= 0.021: the same tolerances as above. Its rope is llama.cpp's normal
# one (adjacent pairs) where transformers un-permutes q/k and rotates halves: a wrong pairing moves
# the logits by whole units.


@pytest.fixture(scope="module")
def chat(chat_model):
    return chat_model, Driver.load(str(chat_model), slots=0, context=512, kv="f32")


def test_chat_model_matches_reference(chat):
    path, driver = chat
    check(path, driver, PROMPTS[0], 16, atol=1e-3)


def test_chat_model_with_the_defaults_matches_reference(chat_model):
    driver = Driver.load(str(chat_model), slots=0, context=512)
    check(chat_model, driver, PROMPTS[2], 16, atol=3e-2, activations="int16")
