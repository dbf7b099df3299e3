"""What decode windows replayed from CUDA graphs (cuda_graphs.py) and from CPU plans (cpu_plans.py) share: the
model's MoE layers, whose routed entries a replay must count as its Python would have, and the figures both
report (`bench-engine`)."""

from __future__ import annotations

from engine.experts import Experts, ExpertStats
from engine.models.base import Model


class Replays:
    def __init__(self, model: Model):
        self.model = model
        self.experts: list[Experts] = [b.experts for b in model.blk if hasattr(b, "experts")]
        self.captures = 0
        self.replays = 0
        self.failed: str | None = None  # why replays were turned off

    def counted(self) -> list[ExpertStats]:
        """Each MoE layer's entries counted on the host so far."""
        return [e.counted() for e in self.experts]

    def counted_since(self, before: list[ExpertStats]) -> list[ExpertStats]:
        """Each MoE layer's entries counted since `before` (an earlier `counted()`): what one window counted."""
        return [now - b for now, b in zip(self.counted(), before, strict=True)]

    def recount(self, entries: list[ExpertStats]) -> None:
        """Add each MoE layer's `entries` to its host counts (what a window counted, per layer)."""
        for e, n in zip(self.experts, entries, strict=True):
            e.recount(n)
