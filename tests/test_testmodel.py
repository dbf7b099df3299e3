"""The generated test model: deterministic, complete metadata, and a model transformers can run."""

from __future__ import annotations

import argparse

import pytest
import torch
from gguf import GGMLQuantizationType as gguf_type
from reference import reference_greedy, reference_logits

from engine.gguf_file import GGUFFile
from engine.tokenizer import Tokenizer
from strata_desk import testmodel

QWEN3MOE_KEYS = [
    "context_length", "embedding_length", "block_count", "feed_forward_length", "expert_feed_forward_length",
    "attention.head_count", "attention.head_count_kv", "attention.key_length", "attention.value_length",
    "rope.freq_base", "attention.layer_norm_rms_epsilon", "expert_count", "expert_used_count",
]
TOKENIZER_KEYS = ["model", "pre", "tokens", "token_type", "merges", "bos_token_id", "eos_token_id",
                  "padding_token_id"]


def test_same_seed_same_bytes(tiny_model, tmp_path):
    again = testmodel.write_test_model(tmp_path / "again.gguf")
    assert again.read_bytes() == tiny_model.read_bytes()
    other = testmodel.write_test_model(tmp_path / "other.gguf", seed=1)
    assert other.read_bytes() != tiny_model.read_bytes()
    assert other.stat().st_size == tiny_model.stat().st_size


def test_metadata_and_tensors(tiny_model):
    f = GGUFFile(tiny_model)
    assert f.architecture == "qwen3moe"
    for key in QWEN3MOE_KEYS:
        assert f"qwen3moe.{key}" in f.metadata, key
    for key in TOKENIZER_KEYS:
        assert f"tokenizer.ggml.{key}" in f.metadata, key
    assert f.metadata["tokenizer.ggml.model"] == "gpt2" and f.metadata["tokenizer.ggml.pre"] == "qwen2"
    assert "<|im_start|>" in f.metadata["tokenizer.chat_template"]
    tokens = f.metadata["tokenizer.ggml.tokens"]
    assert len(tokens) == testmodel.TOKENIZER_VOCAB == 3072
    assert tokens[-3:] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    p = testmodel.PRESETS["tiny"]
    assert f.metadata["qwen3moe.block_count"] == p.layers == 4
    assert f.tensors["token_embd.weight"].shape == (len(tokens), p.hidden)
    assert f.tensors["blk.3.ffn_gate_exps.weight"].shape == (p.experts, p.expert_ff, p.hidden)
    assert f.tensors["blk.3.ffn_down_exps.weight"].shape == (p.experts, p.hidden, p.expert_ff)
    assert f.tensors["blk.0.attn_q.weight"].shape == (p.heads * p.head_dim, p.hidden)
    assert f.tensors["blk.0.attn_k_norm.weight"].shape == (p.head_dim,)
    assert {"output.weight", "output_norm.weight"} <= f.tensors.keys()
    assert len(f.tensors) == 3 + 12 * p.layers


def test_q8_0_keeps_router_and_norms_f32(tiny_model_q8):
    f = GGUFFile(tiny_model_q8)
    types = {name: info.qtype.name for name, info in f.tensors.items()}
    assert types["blk.0.ffn_gate_inp.weight"] == "F32"
    assert types["blk.0.attn_norm.weight"] == "F32"
    assert types["blk.0.ffn_up_exps.weight"] == "Q8_0"
    assert types["token_embd.weight"] == "Q8_0"


def test_reference_continuations_depend_on_the_prompt(tiny_model):
    tok = Tokenizer.from_gguf(tiny_model)
    prompts = ["The capital of France is", "The capital of Spain is", "Mara walked along the river and"]
    outs = [reference_greedy(tiny_model, tok.encode(p), 12) for p in prompts]
    assert len({tuple(o) for o in outs}) == len(prompts)  # same last token, different context too
    for out in outs:
        assert len(set(out)) > 3


def test_variants_load_in_transformers(tiny_model, tiny_model_q8, tmp_path):
    ids = Tokenizer.from_gguf(tiny_model).encode("The clockmaker opened the shop")
    f32 = reference_logits(tiny_model, ids)
    q8 = reference_logits(tiny_model_q8, ids)
    bf16_path = testmodel.write_test_model(tmp_path / "tiny-bf16.gguf", dtype="bf16", layers=2)
    bf16 = reference_logits(bf16_path, ids)
    assert f32.shape == q8.shape == bf16.shape == (len(ids), f32.shape[1])
    # quantization moves logits (and can flip a routing choice), but the model stays the same one
    assert torch.nn.functional.cosine_similarity(q8.flatten(), f32.flatten(), dim=0) > 0.9
    assert torch.isfinite(bf16).all()


def test_router_skew_makes_some_experts_hot(tmp_path):
    import numpy as np

    path = testmodel.write_test_model(tmp_path / "skew.gguf", layers=1, router_skew=1.0)
    f = GGUFFile(path)
    emb = f.tensor_data("token_embd.weight")
    router = f.tensor_data("blk.0.ffn_gate_inp.weight")
    x = emb / np.sqrt((emb**2).mean(-1, keepdims=True))
    counts = np.bincount(np.argsort(x @ router.T, axis=-1)[:, -2:].ravel(), minlength=router.shape[0])
    assert counts.max() > 3 * np.median(counts)


def test_big_preset_vocab_is_padded(tmp_path):
    size = testmodel.PRESETS["qwen3-30b-a3b"].vocab
    tokens, types = testmodel.vocabulary(size)
    assert len(tokens) == len(types) == size == 151936
    assert tokens[:len(testmodel.trained_tokenizer().tokens)] == testmodel.trained_tokenizer().tokens
    assert types[-1] == 5 and tokens[-1] == f"[PAD{size - 1}]"
    with pytest.raises(ValueError, match="preset"):
        testmodel.write_test_model(tmp_path / "x.gguf", preset="nope")


def test_cli_arguments(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    testmodel.add_arguments(parser)
    args = parser.parse_args([str(tmp_path / "m.gguf"), "--layers", "1", "--dtype", "q8_0", "--seed", "3",
                              "--router-skew", "0.5"])
    assert testmodel.main(args) == 0
    f = GGUFFile(tmp_path / "m.gguf")
    assert f.metadata["qwen3moe.block_count"] == 1
    assert f.metadata["strata.test_model.seed"] == 3
    assert "wrote" in capsys.readouterr().out


@pytest.fixture(scope="module")
def small_q4_k_m(tmp_path_factory: pytest.TempPathFactory):
    """The small preset (rows of 256 values) in llama.cpp's Q4_K_M mix, 4 layers."""
    return testmodel.write_test_model(tmp_path_factory.mktemp("models") / "small-q4_k_m.gguf", preset="small",
                                      dtype="q4_k_m")


def test_q4_k_m_is_llama_cpp_mix(small_q4_k_m, tmp_path):
    types = {name: info.qtype.name for name, info in GGUFFile(small_q4_k_m).tensors.items()}
    # 4 layers: llama.cpp's use_more_bits picks layers 2 and 3 for attn_v and ffn_down
    for i in range(4):
        more = "Q6_K" if i >= 2 else "Q4_K"
        assert types[f"blk.{i}.attn_v.weight"] == types[f"blk.{i}.ffn_down_exps.weight"] == more
        for name in ("attn_q", "attn_k", "attn_output", "ffn_gate_exps", "ffn_up_exps"):
            assert types[f"blk.{i}.{name}.weight"] == "Q4_K"
        assert types[f"blk.{i}.ffn_gate_inp.weight"] == types[f"blk.{i}.attn_norm.weight"] == "F32"
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    assert [testmodel._more_bits(i, 48) for i in (0, 5, 6, 7, 8, 9, 10, 41, 42, 47)] == [
        True, True, False, False, True, False, False, True, True, True]
    # rows that are not whole K-quant blocks fall back as llama.cpp's do; f16 is one type
    tiny = testmodel.write_test_model(tmp_path / "tiny-q4_k_m.gguf", dtype="q4_k_m", layers=1)
    tiny_types = {info.qtype.name for info in GGUFFile(tiny).tensors.values()}
    assert tiny_types == {"Q5_0", "Q8_0", "F32"}
    f16 = testmodel.write_test_model(tmp_path / "tiny-f16.gguf", dtype="f16", layers=1)
    assert {info.qtype.name for info in GGUFFile(f16).tensors.values()} == {"F16", "F32"}


@pytest.mark.parametrize("qtype", [gguf_type.Q4_K, gguf_type.Q6_K], ids=lambda t: t.name)
def test_kquants_read_back_within_a_step(qtype):
    import numpy as np
    from gguf import quants

    from strata_desk.kquants import QUANTIZERS

    rng = np.random.default_rng(int(qtype))
    x = rng.standard_normal((8, 512), dtype=np.float32) * np.float32(0.05)
    x[0, :256] = 0  # a block of zeros reads back as zeros
    x[1, 0] = 4.0  # one large value in a block (the router-skew channel of the embedding)
    y = quants.dequantize(QUANTIZERS[qtype](x), qtype)
    assert y.shape == x.shape and (y[0, :256] == 0).all() and abs(y[1, 0] - 4.0) < 4.0 / 63
    if qtype == gguf_type.Q4_K:  # 16 levels over each group's range (0 included)
        groups = x.reshape(-1, 32)
        step = (groups.max(1, keepdims=True) - np.minimum(groups.min(1, keepdims=True), 0)) / 15
    else:  # 64 levels, -32..31, scaled to each group's largest |x|
        groups = x.reshape(-1, 16)
        step = np.abs(groups).max(1, keepdims=True) / 31
    # half a step from the rounding, a little more from the group scales rounded to 6 or 8 bits (rows
    # without the large value: beside it the super-block's scale leaves the other groups coarser steps)
    error = np.abs(y - x).reshape(groups.shape)
    assert (error <= 0.6 * step).reshape(8, -1)[2:].all()
    with pytest.raises(ValueError, match="multiple of 256"):
        QUANTIZERS[qtype](x[:, :100])


def test_q4_k_m_and_f16_run_in_the_engine(small_q4_k_m, tmp_path):
    """Both load and run in the engine (CPU) as the model they quantize: their logits follow those of
    the same model in f32 (loosely for Q4_K_M: its steps are ~7% of a weight's spread, and a random
    model's routing amplifies them; a wrong byte layout would leave no likeness at all)."""
    from engine.batch import Span
    from engine.check import Driver

    def logits(path, ids):
        driver = Driver.load(str(path), slots=0, kv="f32")
        return driver.server.runner.forward([Span(0, 0, len(ids))], ids)[0]

    ids = Tokenizer.from_gguf(small_q4_k_m).encode("The clockmaker opened the shop")
    for preset, path in (("small", small_q4_k_m),
                         ("tiny", testmodel.write_test_model(tmp_path / "f16.gguf", dtype="f16"))):
        f32 = logits(testmodel.write_test_model(tmp_path / f"{preset}.gguf", preset=preset), ids)
        quantized = logits(path, ids)
        assert torch.isfinite(quantized).all()
        assert torch.nn.functional.cosine_similarity(quantized, f32, dim=0) > (0.4 if preset == "small" else 0.99)
