"""Gemma 3 (`gemma3`) text models: sliding-window and full-attention layers with their own rope bases,
q/k RMSNorm, four norms per layer, GELU-tanh gated FFN, embeddings scaled by sqrt(hidden), output
tied to the embedding. GGUF norm weights already include Gemma's +1."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from engine.gguf_file import GGUFFile
from engine.layers import Rope, Window, rms_norm
from engine.models.base import Hyper, Model

LOCAL_ROPE_BASE = 10_000.0  # not in the GGUF metadata: Gemma 3's sliding layers use this base
FULL_ATTENTION_EVERY = 6  # every 6th layer attends to the whole context (layers 5, 11, 17, ...)


class Gemma3(Model):
    arch = "gemma3"

    def __init__(self, g: GGUFFile, device: torch.device, dtype: torch.dtype, sessions: int, context: int):
        super().__init__(g, Hyper.from_gguf(g), device, dtype, sessions, context)
        h = self.hyper
        self.window = int(g.arch_key("attention.sliding_window", 512))
        self.rope_full = Rope(h.head_dim, h.rope_base, context, device)
        self.rope_local = Rope(h.head_dim, LOCAL_ROPE_BASE, context, device)
        self.scale = 1.0 / math.sqrt(h.head_dim)
        self.embed_scale = torch.tensor(math.sqrt(h.hidden), dtype=dtype)

    def is_full(self, i: int) -> bool:
        return (i + 1) % FULL_ATTENTION_EVERY == 0

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.w["token_embd"][tokens] * self.embed_scale.to(self.device)

    def block(self, i: int, x: torch.Tensor, rows: Window) -> torch.Tensor:
        w, h = self.w, self.hyper
        p = f"blk.{i}."
        full = self.is_full(i)
        a = rms_norm(x, w[p + "attn_norm"], h.eps)
        rope = self.rope_full if full else self.rope_local
        o = self.attention(i, a, rows, rope, self.scale, None if full else self.window)
        x = x + rms_norm(F.linear(o, w[p + "attn_output"]), w[p + "post_attention_norm"], h.eps)
        m = rms_norm(x, w[p + "ffn_norm"], h.eps)
        f = F.gelu(F.linear(m, w[p + "ffn_gate"]), approximate="tanh") * F.linear(m, w[p + "ffn_up"])
        return x + rms_norm(F.linear(f, w[p + "ffn_down"]), w[p + "post_ffw_norm"], h.eps)
