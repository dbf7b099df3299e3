"""The one reader of a GGUF's hyper-parameters (`{arch}.*` keys), torch-free: the engine builds its
models from it and setup sizes slots and caches from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.gguf_file import GGUFError, GGUFFile

# Architectures with sliding-window attention: every Nth layer attends to the whole context, the
# others to the last `{arch}.attention.sliding_window` positions (not in the metadata for Gemma 3:
# layers 5, 11, 17, ... are full, as in llama.cpp).
FULL_ATTENTION_EVERY = {"gemma3": 6}
DEFAULT_SLIDING_WINDOW = 512


def ring_lengths(windows: tuple[int | None, ...], context: int, max_chunk: int) -> list[int]:
    """Positions each layer's KV keeps per session: the context, or a sliding layer's ring of
    `window + max_chunk` (a chunk of `max_chunk` rows whose first row still sees `window` back)."""
    return [context if w is None else min(context, w + max_chunk) for w in windows]


def as_int(value: Any, default: int = 0) -> int:
    """A key's integer value; a per-layer array (e.g. `head_count_kv` of hybrid models) gives its largest entry."""
    if value is None:
        return default
    if hasattr(value, "__len__"):
        values = [int(v) for v in value]
        return max(values) if values else default
    return int(value)


@dataclass(frozen=True)
class Hyper:
    """Hyper-parameters common to the architectures."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    context: int
    rope_base: float
    eps: float
    vocab: int
    experts: int = 0  # 0: a dense model
    experts_used: int = 0
    windows: tuple[int | None, ...] = ()  # each layer's attention window (None: the whole context)

    @classmethod
    def from_gguf(cls, g: GGUFFile) -> Hyper:
        def need(suffix: str) -> Any:
            value = g.arch_key(suffix)
            if value is None:
                raise GGUFError(f"{g.path}: missing metadata key {g.architecture}.{suffix}")
            return value

        heads = as_int(need("attention.head_count"))
        hidden = as_int(need("embedding_length"))
        embd = g.tensors.get("token_embd.weight")
        layers = as_int(need("block_count"))
        every = FULL_ATTENTION_EVERY.get(g.architecture)
        window = int(g.arch_key("attention.sliding_window", DEFAULT_SLIDING_WINDOW))
        windows = tuple(None if every is None or (i + 1) % every == 0 else window for i in range(layers))
        return cls(
            layers=layers,
            hidden=hidden,
            heads=heads,
            kv_heads=as_int(g.arch_key("attention.head_count_kv"), heads),
            head_dim=as_int(g.arch_key("attention.key_length"), hidden // max(heads, 1)),
            context=as_int(g.arch_key("context_length")),  # 0: unknown
            rope_base=float(g.arch_key("rope.freq_base", 10000.0)),
            eps=float(g.arch_key("attention.layer_norm_rms_epsilon", 1e-6)),
            vocab=embd.shape[0] if embd else len(g.get("tokenizer.ggml.tokens", [])),
            experts=as_int(g.arch_key("expert_count")),
            experts_used=as_int(g.arch_key("expert_used_count")),
            windows=windows,
        )
