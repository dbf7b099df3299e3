"""What setup needs to know about a model, read from its GGUF header (no tensor data is read)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GIB = 1 << 30
_SPLIT = re.compile(r"^(?P<base>.*)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")


def split_parts(model: Path) -> list[Path]:
    """All files of a split GGUF (`-00001-of-00003.gguf` ...), or just the file itself."""
    match = _SPLIT.match(model.name)
    if not match:
        return [model]
    count = int(match["n"])
    return [model.with_name(f"{match['base']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def _as_int(value: Any, default: int = 0) -> int:
    if value is None:
        return default
    if hasattr(value, "__len__"):  # per-layer arrays (e.g. head_count_kv): the largest entry
        values = [int(v) for v in value]
        return max(values) if values else default
    return int(value)


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
    total_bytes: int = 0  # the file(s) on disk
    context_length: int = 0  # the model's trained context (0 = unknown)

    def kv_bytes_per_token(self, bytes_per_elem: int = 2) -> int:
        """K and V of every layer for one token: 2 * layers * kv_heads * head_dim * bytes (bf16 = 2)."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * bytes_per_elem

    def slot_bytes(self, context: int, bytes_per_elem: int = 2) -> int:
        """One batch slot's session: its KV cache at the full context."""
        return self.kv_bytes_per_token(bytes_per_elem) * context

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
        from engine.gguf_file import GGUFFile

        parts = split_parts(Path(model))
        missing = [p for p in parts if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"model file not found: {missing[0]}")
        first = GGUFFile(parts[0])
        expert_bytes = sum(t.nbytes for t in first.tensors.values() if "_exps" in t.name)
        for part in parts[1:]:
            expert_bytes += sum(t.nbytes for t in GGUFFile(part).tensors.values() if "_exps" in t.name)
        n_heads = _as_int(first.arch_key("attention.head_count"), 1)
        embd = _as_int(first.arch_key("embedding_length"), 0)
        head_dim = _as_int(first.arch_key("attention.key_length"), embd // max(n_heads, 1))
        return cls(
            architecture=first.architecture,
            n_layers=_as_int(first.arch_key("block_count")),
            n_kv_heads=_as_int(first.arch_key("attention.head_count_kv"), n_heads),
            head_dim=head_dim,
            n_experts=_as_int(first.arch_key("expert_count")),
            n_experts_used=_as_int(first.arch_key("expert_used_count")),
            expert_bytes=expert_bytes,
            total_bytes=sum(p.stat().st_size for p in parts),
            context_length=_as_int(first.arch_key("context_length")),
        )
