"""A cache slot's copy of one expert matrix: a buffer shaped like the host matrix's storage, and a
`Linear` of the same kind over that buffer, so a slot computes exactly what the host matrix does.

The buffer is filled in place (`copy_`), so the `Linear` built over it once stays valid through every
swap (the CPU kernels' `Matrix` keeps a pointer to its blocks, not a copy)."""

from __future__ import annotations

import torch

from engine.weights import BlockLinear, DenseLinear, Linear


def storage_of(lin: Linear) -> torch.Tensor:
    """The tensor holding `lin`'s weights in their format: a float matrix or the file's blocks."""
    if isinstance(lin, DenseLinear):
        return lin.weight
    if isinstance(lin, BlockLinear):
        return lin.matrix.blocks
    raise TypeError(f"the expert tier cannot hold a {type(lin).__name__} in a cache slot")


def linear_over(like: Linear, buffer: torch.Tensor) -> Linear:
    """A `Linear` of `like`'s kind and format over `buffer` (same shape and dtype as `storage_of(like)`)."""
    if isinstance(like, DenseLinear):
        return DenseLinear(buffer)
    if isinstance(like, BlockLinear):
        return BlockLinear(like.qtype, buffer, like.in_features, activations=like.activations, packed=like.matrix.packed)
    raise TypeError(f"the expert tier cannot hold a {type(like).__name__} in a cache slot")
