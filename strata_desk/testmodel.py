"""A deterministic random mixture-of-experts GGUF (`qwen3moe`) for tests and benchmarks.

The weights are random but the file is real: llama.cpp tensor names and keys, a byte-level BPE
tokenizer trained on a shipped English corpus, and Qwen3's ChatML template. The same arguments
always give the same bytes: every tensor (every expert of a stacked tensor) draws from its own
generator seeded by (seed, tensor name, expert), so tensors can be streamed to disk one chunk at a
time: the `qwen3-30b-a3b` preset has the real shapes and never holds more than one expert in RAM.

    strata-desk make-test-model tiny.gguf
    strata-desk make-test-model big.gguf --preset qwen3-30b-a3b --layers 4 --dtype bf16

`--dtype q4_k_m` is llama.cpp's Q4_K_M mix (`tensor_type`), quantized by `strata_desk.kquants`.
"""

from __future__ import annotations

import argparse
import json
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import lru_cache
from importlib.resources import files
from pathlib import Path

import gguf
import numpy as np
from gguf.quants import quantize

from engine.chat_template import QWEN3_CHAT_TEMPLATE
from strata_desk.kquants import QK_K, QUANTIZERS

QT = gguf.GGMLQuantizationType

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOKENIZER_VOCAB = 3072  # trained BPE plus the three ChatML specials



@dataclass(frozen=True)
class Preset:
    layers: int
    hidden: int
    experts: int
    experts_used: int
    expert_ff: int
    dense_ff: int
    heads: int
    kv_heads: int
    head_dim: int
    context: int
    vocab: int | None  # None: the trained tokenizer's own size
    rope_base: float = 1_000_000.0
    rms_eps: float = 1e-6


PRESETS: dict[str, Preset] = {
    "tiny": Preset(layers=4, hidden=64, experts=8, experts_used=2, expert_ff=32, dense_ff=128, heads=4,
                   kv_heads=2, head_dim=16, context=4096, vocab=None),
    # `strata-desk --demo moe`: enough experts for an expert tier to hold a part of them, a few
    # tok/s or better on a 2-core CPU
    "demo-moe": Preset(layers=8, hidden=256, experts=64, experts_used=4, expert_ff=128, dense_ff=512, heads=4,
                       kv_heads=2, head_dim=64, context=4096, vocab=None),
    # rows of 256 values: the smallest that K-quants (q4_k_m) store as such
    "small": Preset(layers=4, hidden=256, experts=8, experts_used=2, expert_ff=256, dense_ff=512, heads=4,
                    kv_heads=2, head_dim=64, context=4096, vocab=None),
    "qwen3-30b-a3b": Preset(layers=48, hidden=2048, experts=128, experts_used=8, expert_ff=768,
                            dense_ff=6144, heads=32, kv_heads=4, head_dim=128, context=40960, vocab=151936),
}

_SKEW_CHANNEL = 4.0  # value of embedding column 0 when --router-skew is set

_SINGLE: dict[str, QT] = {"f32": QT.F32, "f16": QT.F16, "bf16": QT.BF16, "q8_0": QT.Q8_0}
DTYPES = (*_SINGLE, "q4_k_m")
_FILE_TYPE = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
              "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
              "q4_k_m": gguf.LlamaFileType.MOSTLY_Q4_K_M}
# llama.cpp's types for rows a K-quant cannot hold (not a multiple of 256 values)
_FALLBACK = {QT.Q4_K: QT.Q5_0, QT.Q6_K: QT.Q8_0}


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's `use_more_bits`: the first and last eighth of the layers and every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_type(dtype: str, name: str, shape: tuple[int, ...], layers: int) -> QT:
    """The type of a large tensor (`name`, numpy `shape`) in a model of `dtype`. q4_k_m follows
    llama.cpp's Q4_K_M mix for this architecture (src/llama-quant.cpp, more than 8 experts): Q6_K for
    the head and for attn_v and ffn_down(_exps) in the layers `_more_bits` picks, Q4_K for the rest
    (the embedding too: the head is not tied); rows that are not whole K-quant blocks fall back to
    Q5_0 / Q8_0 as llama.cpp's do (the tiny preset's, all of them)."""
    if dtype != "q4_k_m":
        return _SINGLE[dtype]
    qtype = QT.Q4_K
    if name == "output.weight":
        qtype = QT.Q6_K
    elif ".attn_v." in name or ".ffn_down" in name:
        if _more_bits(int(name.split(".")[1]), layers):
            qtype = QT.Q6_K
    if shape[-1] % QK_K:
        qtype = _FALLBACK[qtype]
    return qtype


# -- tokenizer ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BPEVocab:
    tokens: list[str]
    token_types: list[int]
    merges: list[str]


@lru_cache(maxsize=1)
def trained_tokenizer() -> BPEVocab:
    """A byte-level BPE (Qwen2 split) trained on the shipped corpus, then the ChatML specials.

    Training is deterministic: same corpus, same vocabulary and merges on every run.
    """
    from tokenizers import Regex, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer

    from engine.tokenizer import PRE_TOKENIZER_SPLITS

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_TOKENIZER_SPLITS["qwen2"]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB - len(SPECIAL_TOKENS), min_frequency=1,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus_text().splitlines(keepends=True), trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return BPEVocab(tokens + list(SPECIAL_TOKENS), [1] * len(tokens) + [3] * len(SPECIAL_TOKENS), merges)


def corpus_text() -> str:
    return files("strata_desk").joinpath("data/corpus.txt").read_text(encoding="utf-8")


def vocabulary(vocab_size: int | None = None) -> tuple[list[str], list[int]]:
    """Tokens and token types of the test model, padded to `vocab_size` when given."""
    bpe = trained_tokenizer()
    tokens, types = list(bpe.tokens), list(bpe.token_types)
    if vocab_size is not None:
        if vocab_size < len(tokens):
            raise ValueError(f"vocab {vocab_size} is smaller than the trained tokenizer ({len(tokens)})")
        # padded like Qwen's own GGUFs: placeholder tokens no text ever produces (type UNUSED)
        tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
        types += [5] * (vocab_size - len(types))
    return tokens, types


def _tokenizer_metadata(writer: gguf.GGUFWriter, vocab_size: int | None) -> int:
    tokens, types = vocabulary(vocab_size)
    eot = tokens.index("<|endoftext|>")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(trained_tokenizer().merges)
    writer.add_bos_token_id(eot)
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(eot)
    writer.add_add_bos_token(False)
    writer.add_chat_template(QWEN3_CHAT_TEMPLATE)
    return len(tokens)


# -- weights --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Tensor:
    name: str
    shape: tuple[int, ...]  # numpy order; for stacked experts the first axis is the expert
    qtype: QT
    chunks: Callable[[], Iterator[np.ndarray]]  # float32 pieces in file order

    @property
    def nbytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[self.qtype]
        return int(np.prod(self.shape)) // block * size


def _rng(seed: int, name: str, part: int = 0) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode()), part])


class _Scratch:
    """Reused buffers: fresh 16 MB arrays per chunk cost more in page faults than drawing the numbers."""

    def __init__(self) -> None:
        self._bufs: dict[str, np.ndarray] = {}

    def get(self, key: str, shape: tuple[int, ...], dtype: type) -> np.ndarray:
        n = int(np.prod(shape))
        buf = self._bufs.get(key)
        if buf is None or buf.size < n or buf.dtype != dtype:
            buf = self._bufs[key] = np.empty(max(n, _BLOCK_ELEMENTS), dtype)
        return buf[:n].reshape(shape)


def _uniform(rng: np.random.Generator, shape: tuple[int, ...], std: float, scratch: _Scratch | None = None
             ) -> np.ndarray:
    """Uniform noise with the given standard deviation (much faster to draw than a normal)."""
    out = scratch.get("draw", shape, np.float32) if scratch else np.empty(shape, np.float32)
    rng.random(dtype=np.float32, out=out)
    out -= np.float32(0.5)
    out *= np.float32(std * 12**0.5)
    return out


_BLOCK_ELEMENTS = 1 << 22  # draw and write large tensors in pieces of about 16 MB (f32)


def _row_blocks(shape: tuple[int, ...]) -> Iterator[tuple[int, int]]:
    """(part number, rows) pieces of a tensor's first axis; 1-D tensors are one piece."""
    if len(shape) == 1:
        yield 0, shape[0]
        return
    step = max(1, _BLOCK_ELEMENTS // int(np.prod(shape[1:])))
    for part, start in enumerate(range(0, shape[0], step)):
        yield part, min(step, shape[0] - start)


def _encode(data: np.ndarray, qtype: QT, scratch: _Scratch) -> np.ndarray:
    if qtype == QT.F32:
        return data
    if qtype == QT.F16:
        out = scratch.get("f16", data.shape, np.float16)
        out[...] = data
        return out
    if qtype in QUANTIZERS:
        return QUANTIZERS[qtype](data)
    if qtype == QT.BF16:  # truncate: the file is random anyway, and this is 3x faster than rounding
        out = scratch.get("bf16", data.shape, np.uint16)
        np.right_shift(data.view(np.uint32), 16, out=out, casting="unsafe")
        return out
    return quantize(data, qtype)


def _plan(p: Preset, n_vocab: int, dtype: str, seed: int, router_skew: float, scratch: _Scratch
          ) -> list[_Tensor]:
    h, hd = p.hidden, p.head_dim
    f32 = QT.F32

    def dense(name: str, shape: tuple[int, ...], std: float, q: QT | None = None, mean: float = 0.0) -> _Tensor:
        def gen() -> Iterator[np.ndarray]:
            for part, rows in _row_blocks(shape):
                data = _uniform(_rng(seed, name, part), (rows, *shape[1:]), std, scratch)
                data += np.float32(mean)
                yield data
        return _Tensor(name, shape, tensor_type(dtype, name, shape, p.layers) if q is None else q, gen)

    def experts(name: str, shape: tuple[int, int], std: float) -> _Tensor:
        def gen() -> Iterator[np.ndarray]:
            for e in range(p.experts):
                yield _uniform(_rng(seed, name, e + 1), shape, std, scratch)
        return _Tensor(name, (p.experts, *shape), tensor_type(dtype, name, shape, p.layers), gen)

    def embedding() -> _Tensor:
        name = "token_embd.weight"

        def gen() -> Iterator[np.ndarray]:
            for part, rows in _row_blocks((n_vocab, h)):
                data = _uniform(_rng(seed, name, part), (rows, h), 1.0, scratch)
                if router_skew:
                    data[:, 0] = _SKEW_CHANNEL  # a constant input the routers can be biased on
                yield data
        return _Tensor(name, (n_vocab, h), tensor_type(dtype, name, (n_vocab, h), p.layers), gen)

    def router(layer: int) -> _Tensor:
        name = f"blk.{layer}.ffn_gate_inp.weight"

        def gen() -> Iterator[np.ndarray]:
            rng = _rng(seed, name)
            data = _uniform(rng, (p.experts, h), 2.0 / h**0.5)
            if router_skew:
                # Zipf-like popularity in a different order per layer, on the constant channel:
                # at X=1 the hottest expert's logit rises by about 3.5 on every token
                zipf = 1.0 / (rng.permutation(p.experts) + 1.0)
                profile = (zipf - zipf.mean()) / (zipf.max() - zipf.mean())
                data[:, 0] += (router_skew * profile).astype(np.float32)
            yield data
        return _Tensor(name, (p.experts, h), f32, gen)

    # residual branches get a larger scale than 1/sqrt(fan_in) so that context, not only the
    # current token, decides the next one
    plan = [embedding()]
    for i in range(p.layers):
        b = f"blk.{i}."
        plan += [
            dense(b + "attn_norm.weight", (h,), 0.1, f32, mean=1.0),
            dense(b + "attn_q.weight", (p.heads * hd, h), 1.0 / h**0.5),
            dense(b + "attn_k.weight", (p.kv_heads * hd, h), 1.0 / h**0.5),
            dense(b + "attn_v.weight", (p.kv_heads * hd, h), 1.0 / h**0.5),
            dense(b + "attn_output.weight", (h, p.heads * hd), 1.5 / (p.heads * hd) ** 0.5),
            dense(b + "attn_q_norm.weight", (hd,), 0.1, f32, mean=1.0),
            dense(b + "attn_k_norm.weight", (hd,), 0.1, f32, mean=1.0),
            dense(b + "ffn_norm.weight", (h,), 0.1, f32, mean=1.0),
            router(i),
            experts(b + "ffn_gate_exps.weight", (p.expert_ff, h), 1.0 / h**0.5),
            experts(b + "ffn_up_exps.weight", (p.expert_ff, h), 1.0 / h**0.5),
            experts(b + "ffn_down_exps.weight", (h, p.expert_ff), 3.0 / p.expert_ff**0.5),
        ]
    plan += [
        dense("output_norm.weight", (h,), 0.1, f32, mean=1.0),
        dense("output.weight", (n_vocab, h), 4.0 / h**0.5),
    ]
    return plan


# -- writing --------------------------------------------------------------------------------------

def write_test_model(out: Path, preset: str = "tiny", layers: int | None = None, dtype: str = "f32",
                     seed: int = 0, router_skew: float = 0.0) -> Path:
    """Write the test model to `out` and return its path. Same arguments, same bytes."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    p = PRESETS[preset]
    if layers is not None:
        if layers < 1:
            raise ValueError("layers must be at least 1")
        p = replace(p, layers=layers)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    arch = "qwen3moe"
    writer = gguf.GGUFWriter(out, arch)
    writer.add_name(f"strata-desk test model ({preset})")
    writer.add_file_type(int(_FILE_TYPE[dtype]))
    if dtype in ("q8_0", "q4_k_m"):
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(p.context)
    writer.add_embedding_length(p.hidden)
    writer.add_block_count(p.layers)
    writer.add_feed_forward_length(p.dense_ff)
    writer.add_expert_feed_forward_length(p.expert_ff)
    writer.add_head_count(p.heads)
    writer.add_head_count_kv(p.kv_heads)
    writer.add_key_length(p.head_dim)
    writer.add_value_length(p.head_dim)
    writer.add_rope_freq_base(p.rope_base)
    writer.add_layer_norm_rms_eps(p.rms_eps)
    writer.add_expert_count(p.experts)
    writer.add_expert_used_count(p.experts_used)
    writer.add_uint32("strata.test_model.seed", seed)
    writer.add_float32("strata.test_model.router_skew", float(router_skew))
    n_vocab = _tokenizer_metadata(writer, p.vocab)

    scratch = _Scratch()
    plan = _plan(p, n_vocab, dtype, seed, router_skew, scratch)
    for t in plan:
        writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        assert writer.fout is not None
        fout = writer.fout[0]
        for t in plan:
            writer.write_padding(fout, fout.tell())
            written = 0
            for chunk in t.chunks():
                data = _encode(chunk, t.qtype, scratch)
                data.tofile(fout)
                written += data.nbytes
            if written != t.nbytes:
                raise AssertionError(f"{t.name}: wrote {written} bytes, planned {t.nbytes}")
            writer.write_padding(fout, t.nbytes)
    finally:
        writer.close()
    return out


# -- command line ---------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", type=Path, metavar="OUT.gguf", help="where to write the model")
    parser.add_argument("--preset", choices=list(PRESETS), default="tiny",
                        help="tiny: 4 layers, hidden 64, 8 experts (CI); small: the same with hidden 256 (rows "
                        "K-quants can hold); qwen3-30b-a3b: the real shapes")
    parser.add_argument("--layers", type=int, default=None, help="number of layers (default: the preset's)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="f32",
                        help="type of the large tensors (q4_k_m: llama.cpp's Q4_K_M mix of Q4_K and Q6_K); "
                        "norms and routers stay f32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--router-skew", type=float, default=0.0, metavar="X",
                        help="make some experts hotter (0: uniform routing, 1: strongly skewed)")


def main(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    path = write_test_model(args.out, preset=args.preset, layers=args.layers, dtype=args.dtype,
                            seed=args.seed, router_skew=args.router_skew)
    size = path.stat().st_size
    print(f"wrote {path} ({size / 2**20:.1f} MiB) in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="strata-desk make-test-model")
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
