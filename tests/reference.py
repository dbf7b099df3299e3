"""transformers as the independent reference: a GGUF loaded in float32, cached per path.

    logits = reference_logits(path, ids)      # [len(ids), vocab]
    ids = reference_greedy(path, ids, n)      # the n greedy continuation ids
    tok = reference_tokenizer(path)           # transformers' own tokenizer for the file
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from engine.gguf_file import GGUFFile


def _model_kwargs(path: Path) -> dict[str, Any]:
    meta = GGUFFile(path).metadata
    if meta.get("general.architecture") == "qwen3moe":
        # transformers' GGUF loader ignores expert_feed_forward_length
        return {"moe_intermediate_size": int(meta["qwen3moe.expert_feed_forward_length"])}
    return {}


@contextmanager
def _gguf_py_reused() -> Iterator[None]:
    """While transformers loads a GGUF: one gguf-py reader per file (it reads the header twice, ~8 s
    each for a 49K-token vocabulary on the 2-core test machine) and one tensor name map per
    architecture and depth (it builds one per module, ~400 for SmolLM2). Both are read-only there."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = lru_cache(maxsize=2)(reader)
    gguf.get_tensor_name_map = lru_cache(maxsize=8)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


@lru_cache(maxsize=4)
def reference_model(path: str | Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    path = Path(path)
    with _gguf_py_reused():
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32, **_model_kwargs(path)
        )
    return model.eval()


@lru_cache(maxsize=4)
def reference_tokenizer(path: str | Path) -> Any:
    """transformers' tokenizer for the file, built the way `AutoTokenizer.from_pretrained(dir,
    gguf_file=name)` builds it (its GGUF metadata reader and conversion), minus the model-config
    load that reads every tensor: 7 s instead of 25 s of CPU on the demo model, same results."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    architecture, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(path))
    backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)


@torch.inference_mode()
def reference_logits(path: str | Path, ids: list[int]) -> torch.Tensor:
    """Float32 logits of every position of `ids`: shape [len(ids), vocab]."""
    model = reference_model(path)
    out = model(torch.tensor([ids], dtype=torch.long))
    return out.logits[0].float()


@torch.inference_mode()
def reference_greedy(path: str | Path, ids: list[int], n: int) -> list[int]:
    """The n ids greedy decoding appends to `ids` (no stop tokens, no sampling)."""
    model = reference_model(path)
    prompt = torch.tensor([ids], dtype=torch.long)
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()
