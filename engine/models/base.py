"""What every architecture shares: weights named like GGUF tensors,
the embedding -> blocks -> norm -> head pipeline, and the sessions' KV caches."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.batch import Batch
from engine.experts import ExpertStats
from engine.gguf_file import GGUFFile
from engine.hyper import Hyper
from engine.kv import KVCache
from engine.layers import Rope, attend, rms_norm
from engine.placement import Handoff, LocalHandoff, Placement
from engine.weights import WeightStore

if TYPE_CHECKING:
    from engine.tier import Tier


class Model:
    """Base class: subclasses set `hyper`, implement `block()` and may override `embed()`.

    Weights are attributes named like their GGUF tensors: `token_embd`, `output_norm`, `output` and
    `blk[i].attn_qkv` ..., placed by the `WeightStore` (`self.w`), which also counts their bytes.
    With a layer split (`placement`) each layer's weights and KV live on its stage's device, the
    embedding on the first stage's (`device`), the final norm and the head on the last stage's.
    """

    arch = ""
    tier: Tier | None = None  # the expert tier, when `engine.tier.install_tier` put one in place

    def __init__(self, g: GGUFFile, hyper: Hyper, device: torch.device, dtype: torch.dtype, sessions: int,
                 context: int, max_chunk: int, kv_dtype: torch.dtype, placement: Placement | None = None,
                 host_experts: bool | str = False):
        self.hyper = hyper
        self.placement = placement or Placement.single(device, hyper.layers)
        self.handoff: Handoff = LocalHandoff()
        self.device = device = self.placement.first.device
        last = self.placement.last.device
        self.dtype = dtype
        self.context = context
        self.w = WeightStore(g, device, dtype, host_experts)
        self.token_embd = self.w.linear("token_embd")
        self.output_norm = self.w.vector("output_norm", last)
        if self.w.has("output"):
            self.output = self.w.linear("output", last)
        elif last == device:
            self.output = self.token_embd  # tied head
        else:  # a tied head on another stage's device: a copy there, counted as the head
            self.output = self.w.linear("token_embd", last, key="output.weight")
        self.blk = [self.w.block(i, self.placement.device_of(i)) for i in range(hyper.layers)]
        self.w.loaded()
        self.copy_bytes: dict[str, int] = {}  # the dense copies' bytes per device (`engine.dense_copies`)
        self.kv = KVCache(hyper.windows, sessions, hyper.kv_heads, context, hyper.head_dim, max_chunk, kv_dtype,
                          device, devices=[self.placement.device_of(i) for i in range(hyper.layers)])

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.token_embd.lookup(tokens).to(self.dtype)

    def block(self, i: int, x: torch.Tensor, rows: Batch) -> torch.Tensor:
        raise NotImplementedError

    def attention(self, i: int, a: torch.Tensor, rows: Batch, rope: Rope, scale: float,
                  window: int | None = None) -> torch.Tensor:
        """q/k/v projections, per-head q/k RMSNorm (when the layer has one), rope, attention over the
        sessions: [N, Hq * D]."""
        b, h = self.blk[i], self.hyper
        q, k, v = b.attn_qkv(a)
        q = q.reshape(-1, h.heads, h.head_dim)  # column slices of one product: views, which the CUDA kernels read
        k = k.reshape(-1, h.kv_heads, h.head_dim)
        v = v.reshape(-1, h.kv_heads, h.head_dim)
        normed = hasattr(b, "attn_q_norm")
        q, k = rope.pair(q, k, rows.positions, (b.attn_q_norm, h.eps) if normed else None,
                         (b.attn_k_norm, h.eps) if normed else None)
        return attend(q, k, v, self.kv.k[i], self.kv.v[i], rows, scale, window)

    def forward(self, batch: Batch) -> torch.Tensor:
        """Feed the batch's rows into their sessions' caches; returns each span's last row after
        the final norm, [len(spans), hidden]. Stage after stage: each gets the batch's indices on its
        device (copied once per device) and the hidden state from the stage before (`handoff`)."""
        stages = self.placement.stages
        copies = {self.device: batch}
        with stages[0].active():
            x = self.embed(batch.tokens)
        for before, stage in zip((None, *stages), stages, strict=False):
            if stage.device not in copies:
                copies[stage.device] = batch.to(stage.device)
            rows = copies[stage.device]
            if before is not None:
                x = self.handoff.move(x, before, stage)
            with stage.active():
                for i in stage.layers:
                    x = self.block(i, x, rows)
        return rms_norm(x if rows.single_rows else x[rows.last], self.output_norm, self.hyper.eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of `forward`'s rows, [rows, vocab]."""
        with self.placement.last.active():
            return self.output(hidden).float()

    def expert_stats(self) -> ExpertStats:
        """Routed entries served so far, summed over the layers (counted by each layer's `Experts`; an
        expert tier sums its layers' in fewer operations: this runs twice a decode window)."""
        if self.tier is not None:
            return self.tier.stats()
        if not self.hyper.experts:  # a dense model (its blocks' missing attributes cost an exception each)
            return ExpertStats()
        return sum((b.experts.stats() for b in self.blk if hasattr(b, "experts")), ExpertStats())

    def bytes_per_token(self) -> int:
        """Weight bytes one decoded token reads: every matrix but the embedding (the head reads it
        when tied), and `experts_used` of each layer's experts."""
        return self.bytes_per_window(self.hyper.experts_used)

    def bytes_per_window(self, experts_read: float) -> int:
        """Weight bytes a decode window reads: every matrix but the embedding (the head reads it when tied), and
        `experts_read` of each layer's experts (one row: `experts_used`; several: the distinct experts they route)."""
        h, w = self.hyper, self.w
        dense = w.bytes(lambda n: "_exps" not in n and (n != "token_embd.weight" or self.output is self.token_embd))
        return dense + (round(w.expert_bytes() * experts_read / h.experts) if h.experts else 0)
