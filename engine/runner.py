"""Sessions over one model: prompt reads in chunks, decode windows, prefix reuse between sessions.

Session `n_slots` is the solo session; sessions 0..n_slots-1 are the batch slots. A session holds
tokens whose KV is in its cache rows; any prefix of them can be reused by a later read, in place or
copied into another session.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from engine.layers import Span
from engine.loading import log
from engine.models.base import Model


@dataclass
class Session:
    index: int
    tokens: list[int] = field(default_factory=list)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Runner:
    def __init__(self, model: Model, n_slots: int, exact: bool):
        self.model = model
        self.exact = exact
        self.sessions = [Session(i) for i in range(n_slots + 1)]

    @property
    def solo(self) -> Session:
        return self.sessions[-1]

    def slot(self, index: int) -> Session:
        return self.sessions[index]

    def reuse(self, target: Session, prompt: list[int], busy: set[int]) -> int:
        """Give `target` the longest held prefix of `prompt` found in any session not in `busy`.

        The prompt's last token is always left to read (its logits choose the first new token).
        Returns the number of tokens reused.
        """
        best, best_n = target, common_prefix(target.tokens, prompt)
        for s in self.sessions:
            if s.index in busy or s is target:
                continue
            n = common_prefix(s.tokens, prompt)
            if n > best_n:
                best, best_n = s, n
        n = min(best_n, len(prompt) - 1)
        if best is not target and n:
            t0 = time.perf_counter()
            self.model.kv.copy(best.index, target.index, n)
            log(f"reuse: {n} tokens copied from {self.name(best)} to {self.name(target)} "
                f"in {(time.perf_counter() - t0) * 1000:.1f} ms")
        target.tokens = prompt[:n]
        return n

    def name(self, session: Session) -> str:
        return "the solo session" if session is self.solo else f"slot {session.index}"

    def copy(self, src: Session, dst: Session) -> None:
        self.model.kv.copy(src.index, dst.index, len(src.tokens))
        dst.tokens = list(src.tokens)

    def read(self, session: Session, ids: list[int]) -> torch.Tensor:
        """Feed a prompt chunk into `session`; returns the logits after its last token, [vocab]."""
        span = Span(session.index, len(session.tokens), len(ids))
        logits = self.model.forward(torch.tensor(ids), [span])
        session.tokens.extend(ids)
        return logits[0]

    def decode(self, rows: list[tuple[Session, int]]) -> torch.Tensor:
        """One window: each (session, token) row feeds one token. Returns logits [rows, vocab].

        Exact mode computes every row with the arithmetic of a window of one, so a row's result does
        not depend on the other rows; otherwise the rows share each matrix product.
        """
        spans = [Span(s.index, len(s.tokens), 1) for s, _ in rows]
        tokens = torch.tensor([t for _, t in rows])
        if self.exact and len(rows) > 1:
            logits = torch.cat([self.model.forward(tokens[i : i + 1], [span]) for i, span in enumerate(spans)])
        else:
            logits = self.model.forward(tokens, spans)
        for s, t in rows:
            s.tokens.append(t)
        return logits
