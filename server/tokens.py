"""Prompt tokenization and reply detokenization for the server.

The real vocabulary and chat template come from the model's GGUF through the engine's pure helpers
(`engine.tokenizer`, `engine.chat_template`; never the engine's compute). The `bytes` vocabulary
(config "tokenizer": "bytes") is one id per UTF-8 byte plus ChatML specials, the vocabulary of the
HashLM test model (engine/hashlm.py), with Qwen3's ChatML template (tools, thinking); it needs no
model file.
"""

from __future__ import annotations

import asyncio
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
    def encode_many(self, texts: list[str], add_special: bool = True) -> list[list[int]]: ...
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

    def encode_many(self, texts: list[str], add_special: bool = True) -> list[list[int]]:
        return [self.encode(text, add_special) for text in texts]

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
    return _one_bos(tokenizer, tokenizer.encode(text, add_special=True))


def _one_bos(tokenizer: TokenizerLike, ids: list[int]) -> list[int]:
    bos = tokenizer.bos_id
    return ids[1:] if bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos else ids


class BatchEncoder:
    """Rendered prompts tokenized (`encode_prompt`) off the event loop, in batches: the prompts that come while a batch
    is being tokenized go together into the next one (`encode_many`, which the real tokenizer spreads over the cores
    without the GIL). A lone prompt waits for no other; a burst's are done in about one batch's time. (A thread a
    prompt finished them all late, interleaved: this 2-core CPU, 8 prompts of 200 words, the first done at 6.1 ms and
    the last at 7.3; one batch of 8, 3.8 ms.)"""

    def __init__(self, tokenizer: TokenizerLike):
        self.tokenizer = tokenizer
        self._waiting: list[tuple[str, asyncio.Future[list[int]]]] = []
        self._busy = False

    async def encode(self, text: str) -> list[int]:
        future: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        self._waiting.append((text, future))
        if not self._busy:
            self._next()
        return await future

    def _next(self) -> None:
        batch, self._waiting = self._waiting, []
        self._busy = True
        work = asyncio.get_running_loop().run_in_executor(None, self._encode_all, [text for text, _ in batch])
        work.add_done_callback(lambda done: self._deliver(batch, done))

    def _encode_all(self, texts: list[str]) -> list[list[int] | Exception]:
        try:
            return [_one_bos(self.tokenizer, ids) for ids in self.tokenizer.encode_many(texts, add_special=True)]
        except Exception:  # one text the tokenizer refuses fails its own request only
            return [self._encode_one(text) for text in texts]

    def _encode_one(self, text: str) -> list[int] | Exception:
        try:
            return encode_prompt(self.tokenizer, text)
        except Exception as exc:  # handed to the request that asked
            return exc

    def _deliver(self, batch: list[tuple[str, asyncio.Future[list[int]]]], done: asyncio.Future) -> None:
        self._busy = False
        results = done.result() if not done.cancelled() and done.exception() is None else None
        for i, (_, future) in enumerate(batch):
            if future.done():  # its request went away
                continue
            result = results[i] if results is not None else RuntimeError("the tokenizer's worker stopped")
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)
        if self._waiting:
            self._next()
