"""Llama (`llama`) dense models (SmolLM2, Llama 2/3 style files without rope scaling): GQA attention
without q/k norms and with llama.cpp's normal rope (adjacent pairs: the GGUF converter permutes the
q/k rows for it), SwiGLU FFN, output tied to the embedding when the file has no `output` tensor."""

from __future__ import annotations

import torch

from engine.batch import Batch
from engine.gguf_file import GGUFError, GGUFFile
from engine.hyper import Hyper
from engine.layers import Rope, add, add_rms_norm, default_scale, rms_norm, silu_mul
from engine.models.base import Model
from engine.placement import Placement


def check_runnable(g: GGUFFile, hyper: Hyper) -> None:
    """Refuse the llama files this module would compute wrongly, naming what they need."""
    if hyper.experts:
        raise GGUFError(f"{g.path}: llama with {hyper.experts} experts (Mixtral style) is not supported")
    if "rope_freqs.weight" in g.tensors or g.arch_key("rope.scaling.type", "none") != "none":
        raise GGUFError(f"{g.path}: llama rope scaling (rope_freqs, rope.scaling.*) is not supported")
    rope_dims = int(g.arch_key("rope.dimension_count", hyper.head_dim))
    if rope_dims != hyper.head_dim:
        raise GGUFError(f"{g.path}: llama rope over {rope_dims} of {hyper.head_dim} head dimensions is not supported")


class Llama(Model):
    arch = "llama"

    def __init__(self, g: GGUFFile, device: torch.device, dtype: torch.dtype, sessions: int, context: int,
                 max_chunk: int, kv_dtype: torch.dtype, placement: Placement | None = None):
        hyper = Hyper.from_gguf(g)
        check_runnable(g, hyper)
        super().__init__(g, hyper, device, dtype, sessions, context, max_chunk, kv_dtype, placement)
        self.rope = Rope(hyper.head_dim, hyper.rope_base, context, device, neox=False)
        self.scale = default_scale(hyper.head_dim)

    def block(self, i: int, x: torch.Tensor, rows: Batch) -> torch.Tensor:
        b, h = self.blk[i], self.hyper
        o = self.attention(i, rms_norm(x, b.attn_norm, h.eps), rows, self.rope, self.scale)
        x, m = add_rms_norm(x, b.attn_output(o), b.ffn_norm, h.eps)
        gate, up = b.ffn_gate_up(m)
        return add(x, b.ffn_down(silu_mul(gate, up)))
