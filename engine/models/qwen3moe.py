"""Qwen3-MoE (`qwen3moe`): GQA attention with per-head q/k RMSNorm and NEOX rope, softmax top-k routed
SwiGLU experts renormalised over the chosen k, untied output head."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.gguf_file import GGUFFile
from engine.layers import Rope, Window, default_scale, moe_swiglu, rms_norm, route
from engine.models.base import Hyper, Model


class Qwen3Moe(Model):
    arch = "qwen3moe"

    def __init__(self, g: GGUFFile, device: torch.device, dtype: torch.dtype, sessions: int, context: int):
        hyper = Hyper.from_gguf(g, experts=int(g.arch_key("expert_count", 0)),
                                experts_used=int(g.arch_key("expert_used_count", 0)))
        super().__init__(g, hyper, device, dtype, sessions, context)
        self.rope = Rope(hyper.head_dim, hyper.rope_base, context, device)
        self.scale = default_scale(hyper.head_dim)

    def block(self, i: int, x: torch.Tensor, rows: Window) -> torch.Tensor:
        w, h = self.w, self.hyper
        p = f"blk.{i}."
        o = self.attention(i, rms_norm(x, w[p + "attn_norm"], h.eps), rows, self.rope, self.scale)
        x = x + F.linear(o, w[p + "attn_output"])
        m = rms_norm(x, w[p + "ffn_norm"], h.eps)
        weights, ids = route(m, w[p + "ffn_gate_inp"], h.experts_used, normalize=True)
        return x + moe_swiglu(m, weights, ids, w[p + "ffn_gate_exps"], w[p + "ffn_up_exps"], w[p + "ffn_down_exps"])
