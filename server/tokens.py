"""Prompt tokenization and reply detokenization for the server.

The real vocabulary and chat template come from the model's GGUF through the engine's pure helpers
(`engine.tokenizer`, `engine.chat_template`; never the engine's compute). The `bytes` vocabulary
(config "tokenizer": "bytes") is one id per UTF-8 byte plus ChatML specials, the vocabulary of the
HashLM test model (engine/hashlm.py), with Qwen3's ChatML template (tools, thinking); it needs no
model file.
"""

from __future__ import annotations

import re
from typing import Protocol

from engine.chat_template import QWEN3_CHAT_TEMPLATE, ChatTemplate
from engine.hashlm import BYTE_SPECIALS


class StreamDecoder(Protocol):
    def push(self, token_id: int) -> str: ...
    def flush(self) -> str: ...


class TokenizerLike(Protocol):
    bos_id: int | None
    eos_id: int | None
    stop_ids: frozenset[int]
    add_bos: bool

    def encode(self, text: str, add_special: bool = True) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def token_bytes(self, token_id: int) -> bytes: ...
    def stream_decoder(self) -> StreamDecoder: ...


# ---------------------------------------------------------------------------------------------
# The byte vocabulary


_SPECIAL_RE = re.compile("(" + "|".join(re.escape(s) for s in BYTE_SPECIALS) + ")")


class _ByteStream:
    def __init__(self, stop_ids: frozenset[int]):
        self._pending = bytearray()
        self._stop = stop_ids

    def push(self, token_id: int) -> str:
        if token_id >= 256:
            return "" if token_id in self._stop else self.flush() + _SPECIAL_NAMES.get(token_id, "")
        self._pending.append(token_id)
        try:
            text = self._pending.decode("utf-8")
        except UnicodeDecodeError as exc:
            if exc.reason == "unexpected end of data" and len(self._pending) < 4:
                return ""
            text = self._pending.decode("utf-8", "replace")
        self._pending.clear()
        return text

    def flush(self) -> str:
        text = self._pending.decode("utf-8", "replace")
        self._pending.clear()
        return text


_SPECIAL_NAMES = {v: k for k, v in BYTE_SPECIALS.items()}


class ByteTokenizer:
    """One id per UTF-8 byte; ChatML specials 256..258; no BOS."""

    bos_id = None
    eos_id = 257
    stop_ids = frozenset({257, 258})
    add_bos = False

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        ids: list[int] = []
        for part in _SPECIAL_RE.split(text):
            if part in BYTE_SPECIALS:
                ids.append(BYTE_SPECIALS[part])
            elif part:
                ids.extend(part.encode("utf-8"))
        return ids

    def decode(self, ids: list[int]) -> str:
        stream = self.stream_decoder()
        return "".join(stream.push(i) for i in ids) + stream.flush()

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if token_id < 256 else _SPECIAL_NAMES.get(token_id, "").encode()

    def stream_decoder(self) -> _ByteStream:
        return _ByteStream(self.stop_ids)


# ---------------------------------------------------------------------------------------------


def load_vocabulary(model_path: str, kind: str = "gguf") -> tuple[TokenizerLike, ChatTemplate]:
    """The tokenizer and chat template for a model (kind "gguf"), or the byte vocabulary ("bytes")."""
    if kind == "bytes":
        return ByteTokenizer(), ChatTemplate(QWEN3_CHAT_TEMPLATE, "builtin-qwen3")
    from engine.gguf_file import GGUFFile
    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(model_path)
    metadata = GGUFFile(model_path).metadata
    return tokenizer, ChatTemplate.from_metadata(metadata)


def encode_prompt(tokenizer: TokenizerLike, text: str) -> list[int]:
    """Tokens of a rendered prompt, with the BOS the model wants exactly once."""
    ids = tokenizer.encode(text, add_special=True)
    bos = tokenizer.bos_id
    if bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
        ids = ids[1:]
    return ids
