"""A CUDA prompt forward over several sessions (a burst's reads together) attended in one call a layer: every row's
k and v written into its session's cache by one indexed store each, every span's keys gathered from the caches, and
torch's flash kernel over the spans as sequences of their own lengths (`aten._flash_attention_forward` with
cumulative lengths; its causal mask aligned to each span's last key, as `causal_lower_right` aligns it for one
span). The path it replaces runs ~10 torch ops a span and layer: on an H100 a burst of 8 new prompts (~3,400 tokens,
12 layers) spent 34-48 ms of host time in them against 22 ms this way, and the device waited for the host.

Each span's rows see only their own session's keys, as alone; the values agree with the per-span path within
rounding (tests/test_span_attention.py). Exact mode never reads several prompts in one forward.
"""

from __future__ import annotations

import functools

import torch

from engine import kv_blocks
from engine.batch import Batch
from engine.loading import log

# The gathered keys at most this many times the forward's rows: a burst of new prompts, whose copy of the keys is
# small beside the rows' own activations (which the prompt chunk's measured peak covers). Longer histories take the
# per-span path, which reads the caches where they are.
KEYS_PER_ROW = 2


@functools.cache
def _flash_runs(device: torch.device) -> bool:
    """Whether torch's flash kernel runs on `device` (Ampere or later, a build that has it)."""
    return torch.cuda.get_device_capability(device) >= (8, 0) and hasattr(torch.ops.aten, "_flash_attention_forward")


_failed: set[torch.device] = set()  # devices where the call raised once: the per-span path from then on


def usable(q: torch.Tensor, rows: Batch, window: int | None) -> bool:
    """Whether `attend` takes this forward of several spans on CUDA: a layer without a window (its cache holds the
    context), keys at most `KEYS_PER_ROW` times the rows, 16-bit queries of a head size flash takes."""
    return (window is None and sum(s.end for s in rows.spans) <= KEYS_PER_ROW * q.shape[0]
            and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256
            and q.device not in _failed and _flash_runs(q.device))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           rows: Batch, scale: float) -> torch.Tensor | None:
    """Write the rows' k/v into their sessions' caches, then attend each span over its session, all spans in
    one call: [N, Hq * D]. None where torch's flash call raised (logged once; the caller takes the per-span
    path, which writes the same rows again); running out of memory is raised as it comes.
    q [N, Hq, D]; k, v [N, Hkv, D]; caches [sessions, Hkv, length, D]."""
    index = rows.span_index
    k_cache[index.row_sessions, :, rows.positions] = kv_blocks.store(k, k_cache.dtype)
    v_cache[index.row_sessions, :, rows.positions] = kv_blocks.store(v, v_cache.dtype)
    keys = kv_blocks.load(k_cache[index.key_sessions, :, index.key_positions], q.dtype)  # [K, Hkv, D]
    values = kv_blocks.load(v_cache[index.key_sessions, :, index.key_positions], q.dtype)
    try:
        out = torch.ops.aten._flash_attention_forward(q.contiguous(), keys, values, index.cum_rows, index.cum_keys,
                                                      index.max_rows, index.max_keys, 0.0, True, False, scale=scale)[0]
    except torch.cuda.OutOfMemoryError:
        raise
    except RuntimeError as e:
        _failed.add(q.device)
        log(f"attention: torch's flash call over spans failed ({e}); each span attends alone from now on")
        return None
    return out.reshape(q.shape[0], -1)
