"""Tokenizers built from GGUF metadata with the `tokenizers` library.

A GGUF carries no tokenizer.json, only llama.cpp's `tokenizer.ggml.*` keys. We rebuild the same
`tokenizers` pipeline that transformers' GGUF conversion builds (byte-level BPE for `gpt2`,
SentencePiece-style BPE with byte fallback for `llama`), so ids match the reference exactly.

A SentencePiece vocabulary (Gemma 3: 262,144 tokens) has no merges in the file; they are implied by
the vocabulary: every split of a token into two tokens is a merge, ranked by the token's score
(for Gemma, by its position in the file). Finding those splits string by string costs ~2 s in
Python, so `_implied_merges` does it with rolling hashes in numpy.
"""

from __future__ import annotations

import gc
import re
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from engine.stop_tokens import stop_token_ids

# llama.cpp token types (gguf spec)
_CONTROL, _USER_DEFINED = 3, 4

# Split patterns by `tokenizer.ggml.pre`, as in the tokenizer.json files these vocabularies come from.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS: dict[str, str] = {
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "megrez": _QWEN2_SPLIT,
    "qwen35": _QWEN35_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT,
    "pixtral": _LLAMA3_SPLIT,
    "gpt-4o": _GPT4O_SPLIT,
    "llama4": _GPT4O_SPLIT,
    "minimax-m2": _GPT4O_SPLIT,
}

# Architectures whose SentencePiece vocabulary is Gemma-shaped (see `_sentencepiece`).
_GEMMA_ARCHS = frozenset({"gemma", "gemma2", "gemma3", "gemma3n"})

SUPPORTED_MODELS = ("gpt2", "llama")


class TokenizerError(ValueError):
    """The GGUF describes a tokenizer we cannot build."""


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used to spell byte-level vocabularies."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_of() -> dict[str, int]:
    return {char: byte for byte, char in bytes_to_unicode().items()}


class Tokenizer:
    """Encode/decode with a GGUF model's own vocabulary."""

    def __init__(self, backend: _HFTokenizer, *, model: str, bos_id: int | None, eos_id: int | None,
                 add_bos: bool, add_eos: bool = False, stop_ids: Iterable[int] = ()):
        self.backend = backend
        self.model = model
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = add_bos and bos_id is not None
        self.add_eos = add_eos and eos_id is not None
        self.stop_ids: frozenset[int] = frozenset(stop_ids)
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)

    # -- construction -----------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        from engine.gguf_file import GGUFFile

        return cls.from_metadata(GGUFFile(path).metadata)

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any]) -> Tokenizer:
        kind = metadata.get("tokenizer.ggml.model")
        tokens = metadata.get("tokenizer.ggml.tokens")
        if kind not in SUPPORTED_MODELS:
            raise TokenizerError(
                f"unsupported tokenizer model {kind!r} (tokenizer.ggml.model); supported: {', '.join(SUPPORTED_MODELS)}"
            )
        if not tokens:
            raise TokenizerError("GGUF has no tokenizer.ggml.tokens")
        tokens = list(tokens)
        types = metadata.get("tokenizer.ggml.token_type")
        types = np.asarray(types, dtype=np.int64) if types is not None else np.ones(len(tokens), np.int64)
        arch = str(metadata.get("general.architecture", ""))
        if kind == "gpt2":
            backend, added = _byte_level(tokens, types, metadata)
            default_bos = False
        else:
            backend, added = _sentencepiece(tokens, types, metadata, gemma=arch in _GEMMA_ARCHS)
            default_bos = True
        backend.add_special_tokens(added[0])
        if added[1]:
            backend.add_tokens(added[1])

        def token_id(key: str) -> int | None:
            value = metadata.get(f"tokenizer.ggml.{key}")
            return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

        bos_id, eos_id = token_id("bos_token_id"), token_id("eos_token_id")
        return cls(
            backend, model=kind, bos_id=bos_id, eos_id=eos_id,
            add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", default_bos)),
            add_eos=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
            stop_ids=stop_token_ids(metadata),
        )

    # -- use ----------------------------------------------------------------------------------------

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text become single tokens.

        With `add_special` (and the model's add_bos flag) BOS is prepended, unless the text already
        starts with it (a rendered chat template often writes `<bos>` itself).
        """
        return self.encode_many([text], add_special)[0]

    def encode_many(self, texts: list[str], add_special: bool = True) -> list[list[int]]:
        """`encode` of each text, in one call that the backend spreads over the cores without the GIL (the server
        tokenizes a burst's prompts together, `server.tokens.BatchEncoder`)."""
        out = []
        for encoding in self.backend.encode_batch(texts, add_special_tokens=False):
            ids = encoding.ids
            if add_special:
                if self.add_bos and (not ids or ids[0] != self.bos_id):
                    ids.insert(0, self.bos_id)
                if self.add_eos:
                    ids.append(self.eos_id)
            out.append(ids)
        return out

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (for some tokens a part of a UTF-8 character)."""
        piece = self.id_to_token(token_id) or ""
        if self.model == "gpt2":  # byte-level: each character spells one byte (added tokens: their text)
            byte_of = _byte_of()
            return bytes(byte_of[c] for c in piece) if all(c in byte_of for c in piece) else piece.encode()
        fallback = _BYTE_FALLBACK.fullmatch(piece)  # SentencePiece: a byte token, else "\u2581" for a space
        return bytes([int(fallback[1], 16)]) if fallback else piece.replace("\u2581", " ").encode()

    def stream_decoder(self, skip_special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special)


class StreamDecoder:
    """Turns generated ids into text pieces, holding back incomplete UTF-8 sequences.

    Decodes a short window of recent ids and emits what it adds to the previous window, so that
    decoders which look at neighbours (byte fallback, SentencePiece's leading space) agree with a
    full decode of the whole sequence.
    """

    # Past this many held-back ids the tail is invalid bytes, not a character still arriving
    # (UTF-8 needs at most 4 bytes): emit it rather than re-decode an ever longer window.
    MAX_HELD = 32

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tok = tokenizer
        self._skip = skip_special
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window (context for the decoder)
        self._read = 0  # ids before this have been emitted
        self._before = ""  # decode of ids[prefix:read]

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special=self._skip) if ids else ""

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        text = self._decode(self._ids[self._prefix :])
        held = len(self._ids) - self._read
        if held < self.MAX_HELD and (text.endswith("\ufffd") or len(text) <= len(self._before)):
            return ""
        return self._advance(text)

    def flush(self) -> str:
        """Whatever is held back (an incomplete character decodes as U+FFFD)."""
        out = self._advance(self._decode(self._ids[self._prefix :]))
        self._ids, self._prefix, self._read, self._before = [], 0, 0, ""
        return out

    def _advance(self, text: str) -> str:
        out = text[len(self._before) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._before = self._decode(self._ids[self._prefix : self._read])
        return out


# -- builders -------------------------------------------------------------------------------------

_Added = tuple[list[AddedToken], list[AddedToken]]


def _added_tokens(tokens: list[str], types: np.ndarray, vocab: dict[str, int], byte_level: bool) -> _Added:
    """Control tokens become special added tokens, user-defined ones plain added tokens (as HF)."""
    alphabet = set(bytes_to_unicode().values()) if byte_level else None
    special, plain = [], []
    for i in np.flatnonzero(types == _CONTROL).tolist():
        tok = tokens[i]
        # a control token spelled outside the byte alphabet is a llama.cpp mislabel: skip it
        if alphabet is None or set(tok) <= alphabet:
            special.append(AddedToken(tok, normalized=False, special=True))
    for i in np.flatnonzero(types == _USER_DEFINED).tolist():
        if tokens[i] in vocab:
            plain.append(AddedToken(tokens[i], normalized=False, special=False))
    return special, plain


def _byte_level(tokens: list[str], types: np.ndarray, metadata: dict[str, Any]) -> tuple[_HFTokenizer, _Added]:
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
        for i, t in enumerate(tokens)
    }
    raw_merges = metadata.get("tokenizer.ggml.merges")
    if raw_merges is None:
        raise TokenizerError("byte-level (gpt2) GGUF tokenizer has no tokenizer.ggml.merges")
    merges = [tuple(m.split(" ", 1)) for m in raw_merges]
    backend = _HFTokenizer(
        models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                   end_of_word_suffix="", fuse_unk=False)
    )
    split = PRE_TOKENIZER_SPLITS.get(str(metadata.get("tokenizer.ggml.pre", "")))
    if split is None:  # "default"/"gpt2": GPT-2's own pattern, built into ByteLevel
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    backend.decoder = decoders.ByteLevel()
    return backend, _added_tokens(tokens, types, vocab, byte_level=True)


def _sentencepiece(tokens: list[str], types: np.ndarray, metadata: dict[str, Any], gemma: bool
                   ) -> tuple[_HFTokenizer, _Added]:
    if gemma:
        # Gemma files store whitespace-run tokens with real spaces; its normalizer looks them up as "▁".
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    raw_merges = metadata.get("tokenizer.ggml.merges")
    if raw_merges is not None:
        merges = [tuple(m.split(" ", 1)) for m in raw_merges]
    else:
        if gemma:  # Gemma's scores do not follow its merge order; the file order does
            scores = -np.arange(len(tokens), dtype=np.float64)
        else:
            scores = np.asarray(metadata.get("tokenizer.ggml.scores", np.zeros(len(tokens))), np.float64)
        merges = _implied_merges(vocab, scores)
    unk = metadata.get("tokenizer.ggml.unknown_token_id")
    unk_token = tokens[int(unk)] if unk is not None and 0 <= int(unk) < len(tokens) else None
    backend = _HFTokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=unk_token, fuse_unk=True, byte_fallback=True, dropout=None)
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        backend.normalizer = normalizers.Replace(" ", "\u2581")
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    else:
        prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False
        )
        if prefix:
            steps.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(steps)
    return backend, _added_tokens(tokens, types, vocab, byte_level=False)


# -- merges implied by a vocabulary ---------------------------------------------------------------

_BASES = (0x100000001B3, 0x9E3779B97F4A7C15)
_LEN_MIX = np.uint64(0xFF51AFD7ED558CCD)
_FIB = np.uint64(0x9E3779B97F4A7C15)


class _TokenHashes:
    """Polynomial hashes (mod 2**64) of every prefix of every token, in one flat array.

    at[p] hashes the token's characters from its start through flat position p, so any prefix or
    suffix of a token hashes in O(1) without materialising the substring.
    """

    def __init__(self, codes: np.ndarray, starts: np.ndarray, lens: np.ndarray, base: int):
        self.base = np.uint64(base)
        self.pw = np.ones(int(lens.max(initial=1)) + 1, np.uint64)
        with np.errstate(over="ignore"):
            for j in range(1, len(self.pw)):
                self.pw[j] = self.pw[j - 1] * self.base
            self.at = codes.copy()
            # one vectorised step per character offset: at[p] = at[p-1] * base + c[p]
            for j in range(1, len(self.pw) - 1):
                pos = starts[lens > j] + j
                self.at[pos] += self.at[pos - 1] * self.base

    def prefix(self, start: np.ndarray, length: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            return self.at[start + length - 1] ^ (length.astype(np.uint64) * _LEN_MIX)

    def suffix(self, start: np.ndarray, cut: np.ndarray, end: np.ndarray) -> np.ndarray:
        """Hash of [cut, end) inside the token that starts at `start` (cut > start)."""
        with np.errstate(over="ignore"):
            h = self.at[end - 1] - self.at[cut - 1] * self.pw[end - cut]
            return h ^ ((end - cut).astype(np.uint64) * _LEN_MIX)


class _HashIndex:
    """Open-addressing table from 64-bit keys to row numbers, built and probed with numpy."""

    def __init__(self, keys: np.ndarray):
        bits = max(4, int(len(keys) * 4 - 1).bit_length())  # load factor <= 1/4
        self.shift = np.uint64(64 - bits)
        self.mask = (1 << bits) - 1
        self.keys = np.zeros(1 << bits, np.uint64)
        self.rows = np.full(1 << bits, -1, np.int64)
        pending = np.arange(len(keys))
        slot = self._slot(keys)
        while len(pending):
            free = self.rows[slot] < 0
            cand, cand_slot = pending[free], slot[free]
            _, winner = np.unique(cand_slot, return_index=True)
            self.rows[cand_slot[winner]] = cand[winner]
            self.keys[cand_slot[winner]] = keys[cand[winner]]
            placed = np.zeros(len(pending), bool)
            placed[np.flatnonzero(free)[winner]] = True
            pending, slot = pending[~placed], (slot[~placed] + 1) & self.mask

    def _slot(self, keys: np.ndarray) -> np.ndarray:
        # Fibonacci hashing: polynomial hashes mod 2**64 are poorly mixed in their low bits
        with np.errstate(over="ignore"):
            return ((keys * _FIB) >> self.shift).astype(np.int64)

    def find(self, keys: np.ndarray) -> np.ndarray:
        """Row of each key, or -1."""
        slot = self._slot(keys)
        out = self.rows[slot]
        todo = np.flatnonzero((out >= 0) & (self.keys[slot] != keys))  # collided: probe on
        out[todo] = -1
        slot = (slot[todo] + 1) & self.mask
        while len(todo):
            rows = self.rows[slot]
            hit = (rows >= 0) & (self.keys[slot] == keys[todo])
            out[todo[hit]] = rows[hit]
            go_on = (rows >= 0) & ~hit
            todo, slot = todo[go_on], (slot[go_on] + 1) & self.mask
        return out


def _implied_merges(vocab: dict[str, int], scores: np.ndarray) -> list[tuple[str, str]]:
    """Every (left, right) with left, right and left+right in `vocab`, best first.

    Same set and order as transformers' `generate_merges`: by the merged token's score
    (descending), then longer left piece first, then vocabulary order. Pieces are found by hashing
    every prefix/suffix of every token at once; a second independent hash confirms each match.
    """
    uniq = list(vocab)
    ids = np.fromiter(vocab.values(), dtype=np.int64, count=len(uniq))
    lens = np.fromiter(map(len, uniq), dtype=np.int64, count=len(uniq))
    codes = np.frombuffer("".join(uniq).encode("utf-32-le"), dtype=np.uint32).astype(np.uint64) + np.uint64(1)
    ends = np.cumsum(lens)
    starts = ends - lens

    # every split point, token by token, longest left piece first
    n_splits = np.maximum(lens - 1, 0)
    owner = np.repeat(np.arange(len(uniq)), n_splits)
    k = lens[owner] - 1 - (np.arange(len(owner)) - (np.cumsum(n_splits) - n_splits)[owner])
    start = starts[owner]

    h1, h2 = (_TokenHashes(codes, starts, lens, base) for base in _BASES)
    index = _HashIndex(h1.prefix(starts, lens))
    confirm = h2.prefix(starts, lens)
    left = index.find(h1.prefix(start, k))
    keep = np.flatnonzero(left >= 0)
    owner, k, start, left = owner[keep], k[keep], start[keep], left[keep]
    end = ends[owner]
    right = index.find(h1.suffix(start, start + k, end))
    keep = right >= 0
    owner, k, start, end, left, right = owner[keep], k[keep], start[keep], end[keep], left[keep], right[keep]
    keep = (h2.prefix(start, k) == confirm[left]) & (h2.suffix(start, start + k, end) == confirm[right])
    owner, k, left, right = owner[keep], k[keep], left[keep], right[keep]

    token_scores = scores[ids]
    if len(token_scores) > 1 and not np.all(token_scores[1:] < token_scores[:-1]):
        # lexsort's last key is the primary one; with strictly falling scores (Gemma) the
        # enumeration order above is already the answer
        rank = np.lexsort((owner, k - lens[owner], -k, -token_scores[owner]))
        left, right = left[rank], right[rank]
    pieces = np.array(uniq, dtype=object)
    gc_was_on = gc.isenabled()
    gc.disable()  # 500K tuples would trigger many needless collections
    try:
        return list(zip(pieces[left].tolist(), pieces[right].tolist(), strict=True))
    finally:
        if gc_was_on:
            gc.enable()
