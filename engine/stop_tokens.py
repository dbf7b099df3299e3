"""Which token ids end a generation: EOS plus the end-of-turn tokens chat templates emit."""

from __future__ import annotations

from typing import Any

END_OF_TURN = ("<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<|eot_id|>", "<|end|>", "<|return|>", "<eos>")


def stop_token_ids(metadata: dict[str, Any]) -> frozenset[int]:
    ids = {int(metadata[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in metadata}
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    wanted = set(END_OF_TURN)
    ids.update(i for i, t in enumerate(tokens) if t in wanted)
    return frozenset(ids)
