"""Qwen3-MoE (`qwen3moe`): GQA attention with per-head q/k RMSNorm and NEOX rope, softmax top-k routed
SwiGLU experts renormalised over the chosen k, untied output head."""

from __future__ import annotations

import torch

from engine.batch import Batch
from engine.experts import resident_experts, route
from engine.gguf_file import GGUFFile
from engine.hyper import Hyper
from engine.layers import Rope, add_rms_norm, default_scale, rms_norm
from engine.models.base import Model
from engine.placement import Placement


class Qwen3Moe(Model):
    arch = "qwen3moe"

    def __init__(self, g: GGUFFile, device: torch.device, dtype: torch.dtype, sessions: int, context: int,
                 max_chunk: int, kv_dtype: torch.dtype, placement: Placement | None = None,
                 host_experts: bool = False):
        hyper = Hyper.from_gguf(g)
        super().__init__(g, hyper, device, dtype, sessions, context, max_chunk, kv_dtype, placement, host_experts)
        self.rope = Rope(hyper.head_dim, hyper.rope_base, context, device)
        self.scale = default_scale(hyper.head_dim)
        for i, b in enumerate(self.blk):  # the expert tier (engine/tier) puts its own in place of these
            device = self.w.experts_device if self.w.host_experts else self.placement.device_of(i)
            b.experts = resident_experts(b.ffn_gate_exps, b.ffn_up_exps, b.ffn_down_exps, device)

    def block(self, i: int, x: torch.Tensor, rows: Batch) -> torch.Tensor:
        b, h = self.blk[i], self.hyper
        o = self.attention(i, rms_norm(x, b.attn_norm, h.eps), rows, self.rope, self.scale)
        x, m = add_rms_norm(x, b.attn_output(o), b.ffn_norm, h.eps)
        weights, ids = route(m, b.ffn_gate_inp, h.experts_used, normalize=True)
        return b.experts(m, weights, ids, residual=x)
