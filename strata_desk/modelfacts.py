"""What setup needs to know about a model, read from its GGUF header (no tensor data is read)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

GIB = 1 << 30


@dataclass(frozen=True)
class ModelFacts:
    """The sizes the parallel recommendation needs. Bytes are bytes; `*_gib` properties convert."""

    architecture: str
    n_layers: int
    n_kv_heads: int
    head_dim: int
    n_experts: int = 0  # 0 = dense model
    n_experts_used: int = 0
    expert_bytes: int = 0  # all routed experts of all layers, as stored in the file
    layer_expert_bytes: int = 0  # the routed experts of the largest layer (the most the GPU tier stages)
    dense_bytes: int = 0  # every other tensor, as stored in the file
    total_bytes: int = 0  # the file(s) on disk
    context_length: int = 0  # the model's trained context (0 = unknown)
    windows: tuple[int | None, ...] = ()  # each layer's attention window (empty or None: the whole context)

    def kv_bytes_per_token(self, bytes_per_elem: int = 2) -> int:
        """K and V of every layer for one token: 2 * layers * kv_heads * head_dim * bytes (bf16 = 2)."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * bytes_per_elem

    def slot_bytes(self, context: int, bytes_per_elem: int = 2, max_chunk: int = 512) -> int:
        """One batch slot's session: its KV cache at `context`, sliding-window layers keeping only
        their ring (engine.hyper.ring_lengths; `max_chunk` is the engine's --prefill)."""
        from engine.hyper import ring_lengths

        windows = self.windows or (None,) * self.n_layers
        positions = sum(ring_lengths(windows, context, max_chunk))
        return 2 * positions * self.n_kv_heads * self.head_dim * bytes_per_elem

    @property
    def dense(self) -> bool:
        return self.n_experts == 0

    @property
    def expert_gib(self) -> float:
        return self.expert_bytes / GIB

    @property
    def total_gib(self) -> float:
        return self.total_bytes / GIB

    @classmethod
    def from_gguf(cls, model: Path) -> ModelFacts:
        """Read the facts from the header(s); raises engine.gguf_file.GGUFError or FileNotFoundError."""
        from engine.gguf_file import GGUFFile, split_parts  # numpy and gguf: imported when used
        from engine.hyper import Hyper

        parts = split_parts(Path(model))
        missing = [p for p in parts if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"model file not found: {missing[0]}")
        g = GGUFFile(parts[0])
        h = Hyper.from_gguf(g)
        return cls(
            architecture=g.architecture,
            n_layers=h.layers,
            n_kv_heads=h.kv_heads,
            head_dim=h.head_dim,
            n_experts=h.experts,
            n_experts_used=h.experts_used,
            expert_bytes=sum(t.nbytes for t in g.tensors.values() if "_exps" in t.name),
            layer_expert_bytes=max((sum(t.nbytes for t in g.tensors.values() if t.name.startswith(f"blk.{i}.")
                                        and "_exps" in t.name) for i in range(h.layers)), default=0),
            dense_bytes=sum(t.nbytes for t in g.tensors.values() if "_exps" not in t.name),
            total_bytes=sum(p.stat().st_size for p in parts),
            context_length=h.context,
            windows=h.windows,
        )
