"""Which token ids end a generation: EOS, EOT/EOM, and the end-of-turn tokens chat formats emit.

One list for the engine (which stops on them) and the tokenizer (which reports them to the server).
"""

from __future__ import annotations

from typing import Any

END_OF_TURN_TOKENS = (
    "<|im_end|>", "<end_of_turn>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end|>",
    "<|return|>", "<|call|>",
)


def stop_token_ids(metadata: dict[str, Any]) -> frozenset[int]:
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    ids = set()
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = metadata.get(f"tokenizer.ggml.{key}")
        if value is not None and (not tokens or 0 <= int(value) < len(tokens)):
            ids.add(int(value))
    wanted = set(END_OF_TURN_TOKENS)
    ids.update(i for i, t in enumerate(tokens) if t in wanted)
    return frozenset(ids)
