"""Token choice: penalties, then greedy or temperature / top-k / top-p / min-p with a counter-based draw.

The uniform number for the token at position `p` of a request with seed `s` is Philox4x32-10 keyed
by `s` with counter `p`: a row draws the same number alone or in any batch, on any device, so a
sampled request's tokens depend only on its seed, its logits and its positions. Penalties change a
row's own logits from its own recent tokens (elementwise), so they keep that property.

A row whose request asked for log-probabilities (`Sampling.logprobs` >= 0) gets its token as a
`Pick`: an int that also carries its `Logprob` (the penalized logits' log-softmax), so every caller
that only wants the id is unchanged.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from engine.batch import to_device
from engine.kernels import ops as cpu_ops
from engine.protocol import TOP_K_MAX, Logprob, Sampling

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


class Pick(int):
    """A chosen token id with its `Logprob`, for a request that asked for log-probabilities."""

    logprob: Logprob

    def __new__(cls, token: int, logprob: Logprob) -> Pick:
        pick = super().__new__(cls, token)
        pick.logprob = logprob
        return pick


def logprob_of(token: int) -> Logprob | None:
    """The log-probabilities a chosen token carries (a `Pick`), else None."""
    return token.logprob if isinstance(token, Pick) else None


@dataclass(frozen=True)
class Draw:
    """How one row chooses its token: the request's sampling, its seed, the token's position, and
    the tokens its penalties count (empty without penalties)."""

    sampling: Sampling
    seed: int
    position: int
    recent: tuple[int, ...] = ()

    @classmethod
    def after(cls, sampling: Sampling, seed: int, context: list[int]) -> Draw:
        """The draw of the token that follows `context` (the row's prompt and generated tokens)."""
        return cls(sampling, seed, len(context), tuple(sampling.penalty_window(context)))


def sample_rows(logits: torch.Tensor, draws: list[Draw]) -> list[int]:
    """Choose every row's token in one pass and one device-to-host read. logits: [rows, vocab] float32.

    Sampled rows all keep TOP_K_MAX candidates and mask their own top_k, so a row's arithmetic is
    the same alone or beside any other rows.
    """
    logits = penalize(logits, draws)
    ids: list[int] = _chosen(logits, draws).tolist()
    asked = [i for i, d in enumerate(draws) if d.sampling.logprobs >= 0]
    if asked:
        for i, logprob in zip(asked, _logprobs(logits[asked], [ids[i] for i in asked],
                                               [draws[i].sampling.logprobs for i in asked]), strict=True):
            ids[i] = Pick(ids[i], logprob)
    return ids


def choose(logits: torch.Tensor, draws: list[Draw]) -> torch.Tensor:
    """`sample_rows`' ids (without log-probabilities) as an int64 tensor on the logits' device, not read back."""
    return _chosen(penalize(logits, draws), draws)


def _chosen(logits: torch.Tensor, draws: list[Draw]) -> torch.Tensor:
    chosen = cpu_ops.argmax(logits) if cpu_ops.usable(logits) else logits.argmax(dim=-1)
    sampled = [i for i, d in enumerate(draws) if not d.sampling.greedy]
    if sampled:
        chosen[sampled] = _sample(logits[sampled], [draws[i] for i in sampled])
    return chosen


def _logprobs(logits: torch.Tensor, chosen: list[int], tops: list[int]) -> list[Logprob]:
    """Each row's chosen token's log-probability and its `tops[row]` most likely tokens', one host read."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    values = lp.gather(1, torch.tensor(chosen, device=lp.device)[:, None])[:, 0]
    top_lp, top_ids = torch.topk(lp, max(tops), dim=-1) if max(tops) else (lp[:, :0], lp[:, :0].long())
    values, top_lp, top_ids = values.tolist(), top_lp.tolist(), top_ids.tolist()
    return [Logprob(values[r], tuple(zip(top_ids[r][:n], top_lp[r][:n], strict=True)))
            for r, n in enumerate(tops)]


def penalize(logits: torch.Tensor, draws: list[Draw]) -> torch.Tensor:
    """llama.cpp's penalties on each row's logits of the tokens in its `recent` window: divided by
    repeat_penalty (multiplied when <= 0), then minus count * frequency_penalty + presence_penalty.
    Returns `logits` itself when no row has penalties, else a penalized copy."""
    rows: list[int] = []
    ids: list[int] = []
    counts: list[int] = []
    params: list[tuple[float, float, float]] = []
    for row, d in enumerate(draws):
        seen = Counter(d.recent)
        s = d.sampling
        rows += [row] * len(seen)
        ids += seen.keys()
        counts += seen.values()
        params += [(s.repeat_penalty, s.frequency_penalty, s.presence_penalty)] * len(seen)
    if not rows:
        return logits

    def column(values: list, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return to_device(values, dtype, logits.device)

    at = (column(rows, torch.int64), column(ids, torch.int64))
    repeat, frequency, presence = column(params).unbind(1)
    values = logits[at]
    values = torch.where(values <= 0, values * repeat, values / repeat)
    values = values - (column(counts) * frequency + presence)
    out = logits.clone()
    out[at] = values
    return out


def _sample(logits: torch.Tensor, draws: list[Draw]) -> torch.Tensor:
    def column(values: list[float], dtype=torch.float64) -> torch.Tensor:
        return to_device(values, dtype, logits.device)[:, None]

    k = min(TOP_K_MAX, logits.shape[-1])
    temperature = column([d.sampling.temperature for d in draws])
    top_logits, top_ids = torch.topk(logits.double() / temperature, k)  # sorted, descending
    top_k = column([min(d.sampling.top_k or k, k) for d in draws], torch.int64)
    rank = torch.arange(k, device=logits.device)[None, :]
    probs = torch.softmax(top_logits.masked_fill(rank >= top_k, float("-inf")), dim=-1)
    keep = rank < top_k
    top_p = column([d.sampling.top_p for d in draws])
    keep &= (torch.cumsum(probs, dim=-1) - probs < top_p) | (top_p >= 1.0)
    keep &= probs >= column([d.sampling.min_p for d in draws]) * probs[:, :1]
    probs = torch.where(keep, probs, torch.zeros_like(probs))
    cdf = torch.cumsum(probs / probs.sum(dim=-1, keepdim=True), dim=-1)
    u = column([philox_uniform(d.seed, d.position) for d in draws])
    index = torch.minimum(torch.searchsorted(cdf, u, right=True), top_k - 1)
    return top_ids.gather(1, index)[:, 0]
