"""One module per architecture; `load_model` picks it by `general.architecture`."""

from __future__ import annotations

import torch

from engine.gguf_file import GGUFError, GGUFFile
from engine.models.base import Model
from engine.models.gemma3 import Gemma3
from engine.models.hashlm import HashLM
from engine.models.llama import Llama
from engine.models.qwen3moe import Qwen3Moe
from engine.placement import Placement
from engine.quants import check_supported

ARCHITECTURES: dict[str, type[Model]] = {
    "qwen3moe": Qwen3Moe, "gemma3": Gemma3, "llama": Llama, "hashlm": HashLM,
}


def architecture_of(g: GGUFFile) -> type[Model]:
    """The module for the file's architecture; refuses one we cannot run, naming it."""
    cls = ARCHITECTURES.get(g.architecture)
    if cls is None:
        known = ", ".join(sorted(ARCHITECTURES))
        raise GGUFError(f"{g.path}: architecture {g.architecture or '(none)'!r} is not supported (supported: {known})")
    check_supported(g)
    return cls


def load_model(g: GGUFFile, device: torch.device, dtype: torch.dtype, sessions: int, context: int,
               max_chunk: int = 512, kv_dtype: torch.dtype | None = None, placement: Placement | None = None,
               host_experts: bool | str = False) -> Model:
    """The model with KV for `sessions` sessions; reads feed at most `max_chunk` rows per forward; its
    layers placed as `placement` says (default: all on `device`); `host_experts`: a MoE model's routed
    experts stay in host memory (the expert tier on a GPU: pinned, or `weights.MAPPED`)."""
    cls = architecture_of(g)
    if host_experts and cls is not Qwen3Moe:
        raise GGUFError(f"{g.path}: the expert tier needs a MoE model with SwiGLU expert stacks (qwen3moe)")
    extra = {"host_experts": host_experts} if host_experts else {}
    return cls(g, device, dtype, sessions, context, max_chunk, kv_dtype or dtype, placement, **extra)
