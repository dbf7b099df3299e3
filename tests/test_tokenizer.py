"""engine.tokenizer against transformers' own GGUF tokenizer, on the test model and the demo model."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
from reference import reference_tokenizer

from engine.gguf_file import GGUFFile
from engine.tokenizer import Tokenizer, TokenizerError
from server.tokens import BatchEncoder, ByteTokenizer, encode_prompt

TEXTS = [
    "The capital of France is",
    "Hello, world!",
    "  leading spaces and trailing   ",
    "tabs\tand\nnew\n\nlines\r\n",
    "multiple     spaces      between",
    "café naïve résumé crème brûlée",
    "Привет, как дела?",
    "日本語のテキストとこんにちは",
    "emoji 😊👋🏽 and flags 🇫🇷 family 👨‍👩‍👧",
    "def total(numbers):\n    return sum(n * 2 for n in numbers)  # comment\n",
    "if (a != b && c >= 0x1F) { x += 3.14159; }",
    "Numbers: 1234567890, 3.5%, $12.50, 1e-9",
    "don't you'll I'm we've they'd IT'S",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text after bos",
    "a<|endoftext|>b",
    "UPPER lower MiXeD CamelCaseWords snake_case_words",
    "\u200bzero\u200bwidth and \u00a0nbsp",
    "",
    "x",
    "!!!???...---___===",
]


@pytest.fixture(scope="module")
def tiny_tok(tiny_model) -> Tokenizer:
    return Tokenizer.from_gguf(tiny_model)


@pytest.fixture(scope="module")
def demo_tok(demo_model) -> Tokenizer:
    meta = GGUFFile(demo_model).metadata
    start = time.perf_counter()
    tok = Tokenizer.from_metadata(meta)
    print(f"\ndemo tokenizer ({tok.vocab_size} tokens) built in {time.perf_counter() - start:.2f} s")
    return tok


def _check_against_reference(tok: Tokenizer, ref) -> None:
    for text in TEXTS:
        ours = tok.encode(text)
        theirs = ref(text).input_ids
        if text.startswith("<bos>") and tok.add_bos:
            theirs = theirs[1:]  # we do not double a BOS the text already has
        assert ours == theirs, text
        assert tok.decode(ours) == ref.decode(ours), text
        assert tok.decode(ours, skip_special=True) == ref.decode(ours, skip_special_tokens=True), text


def _check_stream(tok: Tokenizer) -> None:
    for text in TEXTS:
        ids = tok.encode(text, add_special=False)
        stream = tok.stream_decoder()
        pieces = [stream.push(i) for i in ids]
        pieces.append(stream.flush())
        assert "".join(pieces) == tok.decode(ids), text
        assert all("\ufffd" not in p for p in pieces[:-1]) or "\ufffd" in text


def test_tiny_matches_transformers(tiny_model, tiny_tok):
    _check_against_reference(tiny_tok, reference_tokenizer(tiny_model))


def test_tiny_special_tokens(tiny_model, tiny_tok):
    im_start, im_end = tiny_tok.token_to_id("<|im_start|>"), tiny_tok.token_to_id("<|im_end|>")
    assert tiny_tok.encode("<|im_start|>user<|im_end|>") == [im_start, *tiny_tok.encode("user"), im_end]
    assert tiny_tok.eos_id == im_end
    assert {im_end, tiny_tok.token_to_id("<|endoftext|>")} <= tiny_tok.stop_ids
    assert tiny_tok.add_bos is False
    assert tiny_tok.vocab_size == len(GGUFFile(tiny_model).metadata["tokenizer.ggml.tokens"])


def test_tiny_stream_decoder(tiny_tok):
    _check_stream(tiny_tok)


def test_stream_decoder_on_random_ids(tiny_tok):
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(tiny_tok.vocab_size) for _ in range(rng.randrange(1, 60))]
        stream = tiny_tok.stream_decoder()
        text = "".join(stream.push(i) for i in ids) + stream.flush()
        assert text == tiny_tok.decode(ids)


def test_stream_decoder_holds_back_partial_utf8(tiny_tok):
    ids = tiny_tok.encode("😊", add_special=False)
    assert len(ids) > 1  # a 4-byte character the tiny vocabulary has no token for
    stream = tiny_tok.stream_decoder()
    assert [stream.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert stream.push(ids[-1]) == "😊"
    assert stream.flush() == ""


def test_demo_known_ids(demo_tok):
    assert demo_tok.encode("The capital of France is") == [2, 818, 5279, 529, 7001, 563]
    assert (demo_tok.bos_id, demo_tok.eos_id, demo_tok.add_bos) == (2, 1, True)
    assert demo_tok.stop_ids == {1, demo_tok.token_to_id("<end_of_turn>")}
    assert demo_tok.vocab_size == 262144
    # a chat template already writes <bos>: encode must not double it
    assert demo_tok.encode("<bos><start_of_turn>user\n")[:2] == [2, 105]


def test_demo_matches_transformers(demo_model, demo_tok):
    _check_against_reference(demo_tok, reference_tokenizer(demo_model))


def test_demo_stream_decoder(demo_tok):
    _check_stream(demo_tok)


TOKEN_BYTES_TEXT = "Grüße, 世界! Tabs\tand  spaces ✓ 🦙"


def token_bytes_spell(tok) -> bool:
    ids = tok.encode(TOKEN_BYTES_TEXT, add_special=False)
    return b"".join(tok.token_bytes(i) for i in ids) == TOKEN_BYTES_TEXT.encode()


def test_token_bytes_of_byte_level_bpe_and_the_bytes_vocabulary(tiny_tok):
    assert token_bytes_spell(tiny_tok)
    byte = ByteTokenizer()
    text = TOKEN_BYTES_TEXT + "<|im_end|>"
    assert b"".join(byte.token_bytes(i) for i in byte.encode(text)) == text.encode()


def test_demo_token_bytes_with_byte_fallback(demo_tok):
    assert token_bytes_spell(demo_tok)
    assert any(demo_tok.id_to_token(i).startswith("<0x") for i in demo_tok.encode("🦙", add_special=False))


def test_unsupported_tokenizer_is_named():
    with pytest.raises(TokenizerError, match="'bert'"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})


class _Counted:
    """A tokenizer that records each `encode_many` batch, refuses texts holding "BAD", and can hold a batch."""

    def __init__(self, inner, gate: threading.Event | None = None):
        self.inner, self.gate, self.batches = inner, gate, []
        self.bos_id, self.eos_id, self.stop_ids, self.add_bos = inner.bos_id, inner.eos_id, inner.stop_ids, inner.add_bos

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        if "BAD" in text:
            raise ValueError("refused")
        return self.inner.encode(text, add_special)

    def encode_many(self, texts: list[str], add_special: bool = True) -> list[list[int]]:
        self.batches.append(len(texts))
        if self.gate is not None:
            self.gate.wait(10)
        return [self.encode(t, add_special) for t in texts]


def test_a_burst_of_prompts_is_tokenized_in_one_batch_behind_the_first(tiny_tok):
    texts = [f"<|im_start|>user\nprompt {i}: " + "word " * (20 + i) for i in range(6)]
    gate = threading.Event()
    counted = _Counted(tiny_tok, gate)
    encoder = BatchEncoder(counted)

    async def burst():
        first = asyncio.create_task(encoder.encode(texts[0]))
        await asyncio.sleep(0.05)  # the first batch (one prompt) is being tokenized, held at the gate
        rest = [asyncio.create_task(encoder.encode(t)) for t in texts[1:]]
        await asyncio.sleep(0.05)
        gate.set()
        return [await first] + [await r for r in rest]

    assert asyncio.run(burst()) == [encode_prompt(tiny_tok, t) for t in texts]
    assert counted.batches == [1, 5]  # the five that came while the first was tokenized went together


def test_a_prompt_the_tokenizer_refuses_fails_alone(tiny_tok):
    encoder = BatchEncoder(_Counted(tiny_tok))

    async def burst():
        return await asyncio.gather(*(encoder.encode(t) for t in ("one", "BAD two", "three")), return_exceptions=True)

    one, bad, three = asyncio.run(burst())
    assert one == encode_prompt(tiny_tok, "one") and three == encode_prompt(tiny_tok, "three")
    assert isinstance(bad, ValueError)


def test_many_equals_one_at_a_time(tiny_tok):
    texts = ["hello world", "<|im_start|>system\nbe brief<|im_end|>", ""]
    assert tiny_tok.encode_many(texts) == [tiny_tok.encode(t) for t in texts]
    assert ByteTokenizer().encode_many(texts) == [ByteTokenizer().encode(t) for t in texts]
