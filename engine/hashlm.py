"""HashLM, the test model: a language model whose next token is a hash of the whole context.

The server, dashboard and CLI tests run the real engine over it (`engine/models/hashlm.py` is the
architecture; `engine/harness.py` adds the tests' timing and fault switches). It costs under a
millisecond a token and its replies are known in advance: `Rule.reply` is the reference a test
compares with. This module is torch-free: the server imports its `BYTE_SPECIALS`, its benchmark and
the tests `write_hashlm` and `Rule`.

Vocabulary: the bytes 0..255 and the ChatML specials of `BYTE_SPECIALS` (the `bytes` tokenizer of
server/tokens.py); `<|im_end|>` ends a reply.

The rule: the context's hash is the sum over its positions p of (token_p + 1) * weight(p); the next
token is a letter of `ALPHABET` chosen by the mixed hash, or the end token for about one hash in
`END_ODDS` (never, when the file says `ends` false). With a reply text in the file the model says
that text instead: the next token continues the longest suffix of the context that begins the text,
and the end token follows the whole text. Either way each token depends on every token before it, so
a request stopped and continued elsewhere (its prompt plus what it generated) goes on as it would
have alone, and batch = solo.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

ARCH = "hashlm"
BYTE_SPECIALS = {"<|im_start|>": 256, "<|im_end|>": 257, "<|endoftext|>": 258}
END = BYTE_SPECIALS["<|im_end|>"]
VOCAB = 256 + len(BYTE_SPECIALS)
HIDDEN = 272  # the hidden state is a one-hot over the vocabulary, padded to a multiple of 16
EXPERTS, EXPERTS_USED, EXPERT_FF = 4, 2, 16
STATE_BYTES = 6  # the hash stays below 2**48: 9 bits of token, 16 of weight, 20 of position
MAX_CONTEXT = 1 << 20
ALPHABET = b"abcdefghijklmnopqrstuvwxyz      ,.etaoinshr"
END_ODDS = 47
_MASK31 = (1 << 31) - 1
_ENDS_KEY, _TEXT_KEY = f"{ARCH}.ends", f"{ARCH}.text"


def mix(x):
    """A 31-bit integer mixer over Python ints or int64 tensors alike (products stay below 2**62)."""
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & _MASK31
    x = ((x ^ (x >> 12)) * 0x297A2D39) & _MASK31
    return x ^ (x >> 15)


def weight(position):
    """Each position's weight in the hash, 1..65535."""
    return (mix(position) & 0xFFFF) | 1


def letter_draw(h):
    """The mixed hash a letter (and the end) is chosen by: 31 bits from the hash's 48."""
    return mix((h & _MASK31) ^ (h >> 31))


@dataclass(frozen=True)
class Rule:
    """What a HashLM file says: whether replies end by themselves, or a fixed reply text."""

    ends: bool = True
    text: str | None = None

    def __post_init__(self) -> None:
        if self.text == "":
            raise ValueError("a HashLM reply text must not be empty")

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any]) -> Rule:
        return cls(bool(metadata.get(_ENDS_KEY, True)), metadata.get(_TEXT_KEY))

    def next_token(self, context: list[int], h: int) -> int:
        """The token after `context`, whose hash is `h` (the reference, one token at a time)."""
        if self.text is not None:
            text = list(self.text.encode())
            for k in range(min(len(text), len(context)), 0, -1):
                if context[-k:] == text[:k]:
                    return text[k] if k < len(text) else END
            return text[0]
        z = letter_draw(h)
        if self.ends and z % END_ODDS == 0:
            return END
        return ALPHABET[(z >> 7) % len(ALPHABET)]

    def reply(self, prompt: list[int], max_new: int) -> tuple[list[int], str]:
        """The tokens and finish (`stop` or `length`) the model gives `prompt` with `max_new`."""
        context = list(prompt)
        h = sum((t + 1) * weight(p) for p, t in enumerate(context))
        out: list[int] = []
        while len(out) < max_new:
            token = self.next_token(context, h)
            out.append(token)
            h += (token + 1) * weight(len(context))
            context.append(token)
            if token == END:
                return out, "stop"
        return out, "length"

    def reply_text(self, prompt: list[int], max_new: int) -> tuple[str, str]:
        """`reply` as the `bytes` tokenizer decodes it: the bytes as UTF-8, specials left out."""
        ids, finish = self.reply(prompt, max_new)
        return bytes(i for i in ids if i < 256).decode("utf-8", "replace"), finish


def write_hashlm(out: str | Path, rule: Rule | None = None) -> Path:
    """Write a HashLM GGUF: the tensors its architecture runs (identity embedding and tied head, a
    unit output norm, routed experts whose down projections are zero) and the rule's keys."""
    import gguf  # here, not above: the server imports this module and needs no numpy at start
    import numpy as np

    rule = rule or Rule()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(out, ARCH)
    writer.add_name("strata-desk HashLM (tests)")
    writer.add_context_length(MAX_CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(1)
    writer.add_head_count(1)
    writer.add_head_count_kv(1)
    writer.add_key_length(STATE_BYTES)
    writer.add_value_length(STATE_BYTES)
    writer.add_expert_count(EXPERTS)
    writer.add_expert_used_count(EXPERTS_USED)
    writer.add_bool(_ENDS_KEY, rule.ends)
    if rule.text is not None:
        writer.add_string(_TEXT_KEY, rule.text)
    names = {v: k for k, v in BYTE_SPECIALS.items()}
    writer.add_token_list([names.get(i, f"<0x{i:02X}>") for i in range(VOCAB)])
    writer.add_eos_token_id(END)
    rng = np.random.default_rng(0)
    writer.add_tensor("token_embd.weight", np.eye(VOCAB, HIDDEN, dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    writer.add_tensor("blk.0.ffn_gate_inp.weight", rng.standard_normal((EXPERTS, HIDDEN), dtype=np.float32))
    for name in ("ffn_gate_exps", "ffn_up_exps"):
        writer.add_tensor(f"blk.0.{name}.weight", rng.standard_normal((EXPERTS, EXPERT_FF, HIDDEN), np.float32))
    writer.add_tensor("blk.0.ffn_down_exps.weight", np.zeros((EXPERTS, HIDDEN, EXPERT_FF), dtype=np.float32))
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return out
