"""Gemma 3 (`gemma3`) text models: sliding-window and full-attention layers with their own rope bases,
q/k RMSNorm, four norms per layer, GELU-tanh gated FFN, embeddings scaled by sqrt(hidden), output
tied to the embedding. GGUF norm weights already include Gemma's +1."""

from __future__ import annotations

import math

import torch

from engine.batch import Batch
from engine.gguf_file import GGUFFile
from engine.hyper import Hyper
from engine.layers import Rope, add, add_rms_norm, gelu_mul, rms_norm, scale
from engine.models.base import Model
from engine.placement import Placement

LOCAL_ROPE_BASE = 10_000.0  # not in the GGUF metadata: Gemma 3's sliding layers use this base


class Gemma3(Model):
    arch = "gemma3"

    def __init__(self, g: GGUFFile, device: torch.device, dtype: torch.dtype, sessions: int, context: int,
                 max_chunk: int, kv_dtype: torch.dtype, placement: Placement | None = None):
        super().__init__(g, Hyper.from_gguf(g), device, dtype, sessions, context, max_chunk, kv_dtype, placement)
        h = self.hyper
        self.rope_full = Rope(h.head_dim, h.rope_base, context, device)
        self.rope_local = Rope(h.head_dim, LOCAL_ROPE_BASE, context, device)
        self.scale = 1.0 / math.sqrt(h.head_dim)
        # sqrt(hidden) rounded to the model's dtype, as the reference multiplies it (bfloat16: 45.25 for 2048)
        self.embed_scale = float(torch.tensor(math.sqrt(h.hidden), dtype=dtype))

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return scale(super().embed(tokens), self.embed_scale)

    def block(self, i: int, x: torch.Tensor, rows: Batch) -> torch.Tensor:
        b, h = self.blk[i], self.hyper
        window = h.windows[i]  # None: a full-attention layer (hyper.FULL_ATTENTION_EVERY)
        a = rms_norm(x, b.attn_norm, h.eps)
        rope = self.rope_full if window is None else self.rope_local
        o = self.attention(i, a, rows, rope, self.scale, window)
        x, m = add_rms_norm(x, rms_norm(b.attn_output(o), b.post_attention_norm, h.eps), b.ffn_norm, h.eps)
        gate, up = b.ffn_gate_up(m)
        return add(x, rms_norm(b.ffn_down(gelu_mul(gate, up)), b.post_ffw_norm, h.eps))
