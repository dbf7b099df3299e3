"""Token choice: greedy, or temperature / top-k / top-p / min-p with a counter-based draw.

The uniform number for the token at position `p` of a request with seed `s` is Philox4x32-10 keyed
by `s` with counter `p`: a row draws the same number alone or in any batch, on any device, so a
sampled request's tokens depend only on its seed, its logits and its positions.
"""

from __future__ import annotations

import torch

from engine.protocol import TOP_K_MAX, Sampling

_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_MASK = 0xFFFFFFFF


def philox_uniform(seed: int, position: int) -> float:
    """Philox4x32-10(key = seed, counter = position) -> a float in [0, 1)."""
    c0, c1, c2, c3 = position & _MASK, (position >> 32) & _MASK, 0, 0
    k0, k1 = seed & _MASK, (seed >> 32) & _MASK
    for _ in range(10):
        p0, p1 = _M0 * c0, _M1 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & _MASK, p1 & _MASK, ((p0 >> 32) ^ c3 ^ k1) & _MASK, p0 & _MASK
        k0, k1 = (k0 + _W0) & _MASK, (k1 + _W1) & _MASK
    return ((c0 << 21) ^ (c1 >> 11)) / float(1 << 53)


def sample(logits: torch.Tensor, sampling: Sampling, seed: int, position: int) -> int:
    """Choose the token for one row. logits: [vocab] float32."""
    if sampling.greedy:
        return int(torch.argmax(logits))
    k = min(sampling.top_k or TOP_K_MAX, TOP_K_MAX, logits.shape[-1])
    top_logits, top_ids = torch.topk(logits.double() / sampling.temperature, k)  # sorted, descending
    probs = torch.softmax(top_logits, dim=-1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if sampling.top_p < 1.0:
        before = torch.cumsum(probs, dim=-1) - probs
        keep &= before < sampling.top_p
    if sampling.min_p > 0.0:
        keep &= probs >= sampling.min_p * probs[0]
    probs = torch.where(keep, probs, torch.zeros_like(probs))
    cdf = torch.cumsum(probs / probs.sum(), dim=-1)
    u = torch.tensor(philox_uniform(seed, position), dtype=cdf.dtype, device=cdf.device)
    index = min(int(torch.searchsorted(cdf, u, right=True)), k - 1)
    return int(top_ids[index])
