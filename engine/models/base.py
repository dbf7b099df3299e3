"""What every architecture shares: hyper-parameters from GGUF keys, weights named like GGUF tensors,
the embedding -> blocks -> norm -> head pipeline, and the sessions' KV caches."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.gguf_file import GGUFError, GGUFFile
from engine.kv import KVCache
from engine.layers import Span
from engine.quants import load_tensor


@dataclass(frozen=True)
class Hyper:
    """Hyper-parameters common to the architectures (read from `{arch}.*` keys)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    context: int
    rope_base: float
    eps: float
    vocab: int
    experts: int = 0
    experts_used: int = 0

    @classmethod
    def from_gguf(cls, g: GGUFFile, **extra) -> Hyper:
        def need(suffix: str):
            value = g.arch_key(suffix)
            if value is None:
                raise GGUFError(f"{g.path}: missing metadata key {g.architecture}.{suffix}")
            return value

        heads = int(need("attention.head_count"))
        hidden = int(need("embedding_length"))
        return cls(
            layers=int(need("block_count")),
            hidden=hidden,
            heads=heads,
            kv_heads=int(g.arch_key("attention.head_count_kv", heads)),
            head_dim=int(g.arch_key("attention.key_length", hidden // heads)),
            context=int(need("context_length")),
            rope_base=float(g.arch_key("rope.freq_base", 10000.0)),
            eps=float(need("attention.layer_norm_rms_epsilon")),
            vocab=int(g.tensors["token_embd.weight"].shape[0]),
            **extra,
        )


class Weights(dict):
    """GGUF tensor name -> torch tensor, e.g. `w["blk.3.ffn_gate_exps"]` (the `.weight` suffix dropped)."""

    @classmethod
    def load(cls, g: GGUFFile, dtype: torch.dtype, device: torch.device) -> Weights:
        w = cls()
        for name, info in g.tensors.items():
            key = name.removesuffix(".weight")
            # norms and the router stay float32: they are tiny and their rounding steers everything
            keep_f32 = len(info.shape) == 1 or key.endswith("ffn_gate_inp")
            w[key] = load_tensor(g, name, torch.float32 if keep_f32 else dtype, device)
        return w

    def bytes(self, predicate=lambda name: True) -> int:
        return sum(t.numel() * t.element_size() for n, t in self.items() if predicate(n))


class Model:
    """Base class: subclasses set `hyper`, implement `block()` and may override `embed()`/`head_weight`."""

    arch = ""

    def __init__(self, g: GGUFFile, hyper: Hyper, device: torch.device, dtype: torch.dtype,
                 sessions: int, context: int):
        self.hyper = hyper
        self.device = device
        self.dtype = dtype
        self.context = context
        self.w = Weights.load(g, dtype, device)
        self.kv = KVCache(hyper.layers, sessions, hyper.kv_heads, context, hyper.head_dim, dtype, device)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.w.get("output", self.w["token_embd"])

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.w["token_embd"][tokens]

    def block(self, i: int, x: torch.Tensor, positions: torch.Tensor, spans: list[Span]) -> torch.Tensor:
        raise NotImplementedError

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, spans: list[Span]) -> torch.Tensor:
        """Feed the window's rows; returns float32 logits of each span's last row, [len(spans), vocab]."""
        positions = torch.cat([torch.arange(s.start, s.end) for s in spans]).to(self.device)
        x = self.embed(tokens.to(self.device))
        for i in range(self.hyper.layers):
            x = self.block(i, x, positions, spans)
        last = torch.tensor([0] + [s.length for s in spans]).cumsum(0)[1:] - 1
        x = self.final_norm(x[last.to(self.device)])
        return torch.nn.functional.linear(x, self.head_weight).float()

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def expert_bytes(self) -> int:
        return self.w.bytes(lambda n: "_exps" in n)
