"""Copies of contiguous byte ranges ("spans") in one Triton launch: what `KVCache.save` and `load` use on CUDA
to park a session's KV rows in pinned host memory and restore them, instead of a torch `copy_` a layer and K/V
(~25-35 us of host time each: a contiguous temporary, a cudaMemcpyAsync, an event for the pinned block).

A span is (source address, destination address, bytes), in device memory or pinned host memory (under CUDA's
unified addressing a kernel reads and writes pinned host memory through its host pointer, as the fused MoE
kernel reads the expert tier's `far` stacks). The table of spans goes to the device with `batch.to_device`;
a program (span, chunk) casts the span's addresses to pointers to words of the largest of 8, 4, 2, 1 bytes
that divides every address and size of the call, and copies its chunk of `BLOCK` words.

Imports Triton: only on CUDA (and in tests, through Triton's interpreter, on CPU memory).
"""

from __future__ import annotations

import contextlib
import functools
import operator

import torch
import triton
import triton.language as tl

from engine.batch import to_device
from engine.kernels import pdl

BLOCK = 1024  # words a program copies at a time
MAX_CHUNKS = 65535  # a grid's second dimension at most: longer spans take several chunks a program


@triton.jit
def _words(address, WORD: tl.constexpr):
    """An int64 address as a pointer to WORD-byte words."""
    if WORD == 8:
        out = address.to(tl.pointer_type(tl.int64))
    elif WORD == 4:
        out = address.to(tl.pointer_type(tl.int32))
    elif WORD == 2:
        out = address.to(tl.pointer_type(tl.int16))
    else:
        out = address.to(tl.pointer_type(tl.int8))
    return out


@triton.jit
def _copy_spans_kernel(table, WORD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (span, chunk): the span's words chunk, chunk + chunks, ... BLOCK at a time; a row of `table`
    is a span's (source address, destination address, bytes)."""
    pdl.wait(PDL)
    row = table + tl.program_id(0).to(tl.int64) * 3
    src, dst = _words(tl.load(row), WORD), _words(tl.load(row + 1), WORD)
    words = tl.load(row + 2) // WORD
    at = tl.arange(0, BLOCK)
    for start in range(tl.program_id(1).to(tl.int64) * BLOCK, words, tl.num_programs(1).to(tl.int64) * BLOCK):
        live = start + at < words
        tl.store(dst + start + at, tl.load(src + start + at, mask=live), mask=live)


def word_bytes(spans: list[tuple[int, int, int]]) -> int:
    """The largest of 8, 4, 2, 1 bytes that divides every address and size of `spans`."""
    every = functools.reduce(operator.or_, (value for span in spans for value in span), 8)
    return every & -every  # the lowest bit set in any of them (8 is among them)


def copy_spans(spans: list[tuple[int, int, int]], device: torch.device) -> None:
    """Copy each span's bytes (source address, destination address, bytes; device or pinned host memory) in
    one launch on `device`'s current stream, the host not waiting. The caller keeps the memory alive until it
    is done (a kernel records no event on a pinned block, as torch's copies do)."""
    longest = max((size for _, _, size in spans), default=0)
    if longest == 0:
        return
    word = word_bytes(spans)
    chunks = min(triton.cdiv(longest // word, BLOCK), MAX_CHUNKS)
    # Triton launches on the current CUDA device, not the table's
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        table = to_device(spans, torch.int64, device)
        _copy_spans_kernel[(len(spans), chunks)](table, WORD=word, BLOCK=BLOCK, num_warps=4, **pdl.launch(device))
