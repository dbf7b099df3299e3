"""What every architecture shares: hyper-parameters from GGUF keys, weights named like GGUF tensors,
the embedding -> blocks -> norm -> head pipeline, and the sessions' KV caches."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.gguf_file import GGUFError, GGUFFile
from engine.kv import KVCache
from engine.layers import Rope, Span, Window, attend, rms_norm
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

    def block(self, i: int, x: torch.Tensor, rows: Window) -> torch.Tensor:
        raise NotImplementedError

    def attention(self, i: int, a: torch.Tensor, rows: Window, rope: Rope, scale: float,
                  window: int | None = None) -> torch.Tensor:
        """q/k/v projections, per-head q/k RMSNorm, rope, attention over the sessions: [N, Hq * D]."""
        w, h, p = self.w, self.hyper, f"blk.{i}."
        q = F.linear(a, w[p + "attn_q"]).view(-1, h.heads, h.head_dim)
        k = F.linear(a, w[p + "attn_k"]).view(-1, h.kv_heads, h.head_dim)
        v = F.linear(a, w[p + "attn_v"]).view(-1, h.kv_heads, h.head_dim)
        q = rope(rms_norm(q, w[p + "attn_q_norm"], h.eps), rows.positions)
        k = rope(rms_norm(k, w[p + "attn_k_norm"], h.eps), rows.positions)
        return attend(q, k, v, self.kv.k[i], self.kv.v[i], rows, scale, window)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, spans: list[Span]) -> torch.Tensor:
        """Feed the window's rows; returns float32 logits of each span's last row, [len(spans), vocab]."""
        rows = Window.of(spans, self.device)
        x = self.embed(tokens.to(self.device))
        for i in range(self.hyper.layers):
            x = self.block(i, x, rows)
        x = rms_norm(x[rows.last], self.w["output_norm"], self.hyper.eps)
        return F.linear(x, self.head_weight).float()

    def expert_bytes(self) -> int:
        return self.w.bytes(lambda n: "_exps" in n)
