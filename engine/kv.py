"""Per-session KV caches, preallocated for the whole context so a window's shapes never change."""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of every layer for `sessions` sessions: `[sessions, kv_heads, context, head_dim]`."""

    def __init__(self, layers: int, sessions: int, kv_heads: int, context: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (sessions, kv_heads, context, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.sessions = sessions

    @staticmethod
    def bytes_per_session(layers: int, kv_heads: int, context: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * layers * kv_heads * context * head_dim * torch.tensor([], dtype=dtype).element_size()

    def copy(self, src: int, dst: int, n: int) -> None:
        """Copy the first `n` positions of session `src` into session `dst`."""
        if src == dst or n == 0:
            return
        for k, v in zip(self.k, self.v, strict=True):
            k[dst, :, :n] = k[src, :, :n]
            v[dst, :, :n] = v[src, :, :n]
