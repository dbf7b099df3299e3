"""The generated test model: deterministic, complete metadata, and a model transformers can run."""

from __future__ import annotations

import argparse

import pytest
import torch
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
