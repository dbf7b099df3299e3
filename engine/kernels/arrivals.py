"""The last program of a group to arrive finishes the group's result, where a second launch did before.

Some kernels' programs each write a share of a result that another step then reads whole: parts of k to add
in order, a row's logits to pick the top-k of. Each such program, after its stores, adds one to its group's
count (an atomic, which releases the stores); the program that reads the group's size minus one is the last,
sees every share (loading them from L2, `cache_modifier=".cg"`), finishes the result and puts the count back
to 0 for the next launch. The finishing step runs the same instructions in the same order whichever program
is last, so the bits are those of a second launch, without its launch (~2 us a small kernel in a decode
window). The counts say only who is last, never what a result is.

`counts(device)` is one zeroed int32 buffer a device, shared by every such kernel: the kernels of a stream
run one after another (with programmatic dependent launch each waits for the one ahead to finish), and each
leaves its counts at 0.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

COUNTS = 1 << 17  # groups a launch can count (a prompt chunk's rows, a matrix's tiles of weight rows)


@triton.jit
def last_to_arrive(count, group):
    """Whether this program is the last of the `group` programs that call this with the int32 at `count` (0
    before the first); the last also puts it back to 0. Call after the program's stores of its share."""
    tl.debug_barrier()  # every thread's stores done before the count releases them
    last = tl.atomic_add(count, 1, sem="acq_rel") == group - 1
    if last:
        tl.store(count, 0)
    return last


@functools.cache
def counts(device: torch.device) -> torch.Tensor:
    """The device's counts, all 0 between launches (allocated once, never freed: CUDA graphs keep its address)."""
    return torch.zeros(COUNTS, dtype=torch.int32, device=device)


def check_groups(groups: int) -> None:
    """Refuse a launch of more groups than `counts` holds."""
    if groups > COUNTS:
        raise ValueError(f"{groups} groups of programs to count, at most {COUNTS}")
