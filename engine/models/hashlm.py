"""HashLM (`hashlm`): the test model of engine/hashlm.py, computed on the real engine path.

Its one layer keeps each session's state in the KV cache: K holds the context's hash after each
position (as bytes), V the token there (for a reply text's suffix match). A forward writes its rows'
state into their sessions' caches, going on from the position before each span, so a session's
tokens depend on what its cache holds: a prefix reused, copied from another session or left by a
yield must be exactly right for a reply to equal `Rule.reply`.

The hidden state is a one-hot over the vocabulary: the embedding gives the fed token's, the layer
replaces each span's last row by the next token's, and the final norm and the tied identity head make
that token the largest logit. The routed experts run so the engine counts their lookups as for any
MoE model (DONE hits/lookups, STATS tier); their down projections are zero, so they add nothing.
"""

from __future__ import annotations

import torch

from engine.batch import Batch
from engine.experts import resident_experts, route
from engine.gguf_file import GGUFFile
from engine.hashlm import ALPHABET, ARCH, END, END_ODDS, STATE_BYTES, Rule, letter_draw, weight
from engine.hyper import Hyper
from engine.models.base import Model
from engine.placement import Placement


class HashLM(Model):
    arch = ARCH

    def __init__(self, g: GGUFFile, device: torch.device, dtype: torch.dtype, sessions: int, context: int,
                 max_chunk: int, kv_dtype: torch.dtype, placement: Placement | None = None):
        super().__init__(g, Hyper.from_gguf(g), device, dtype, sessions, context, max_chunk, kv_dtype, placement)
        self.rule = Rule.from_metadata(g.metadata)
        self.weights = weight(torch.arange(context, device=device))
        self.alphabet = torch.tensor(list(ALPHABET), device=device)
        self.shifts = 8 * torch.arange(STATE_BYTES, device=device)
        text = list(self.rule.text.encode()) if self.rule.text is not None else []
        self.text = torch.tensor(text + [END], device=device)  # the token after k matched bytes is text[k]
        n = len(text)
        j, k = torch.arange(n, device=device), torch.arange(1, n + 1, device=device)[:, None]
        # row k-1 compares the context's last k tokens with the text's first k: tail[n - k + j] with text[j]
        self.suffix_at = (n - k + j).clamp(max=max(n - 1, 0))
        self.suffix_used = j < k
        b = self.blk[0]
        b.experts = resident_experts(b.ffn_gate_exps, b.ffn_up_exps, b.ffn_down_exps, device)

    def block(self, i: int, x: torch.Tensor, rows: Batch) -> torch.Tensor:
        h = self._write_state(rows)
        token = self._text_token(rows) if self.rule.text is not None else self._hash_token(h)
        y = torch.zeros_like(x)
        y[rows.last, token] = 1
        b = self.blk[i]
        weights, ids = route(y, b.ffn_gate_inp, self.hyper.experts_used, normalize=True)
        return y + b.experts(y, weights, ids)

    def _write_state(self, rows: Batch) -> torch.Tensor:
        """Write every row's hash and token into its session's cache; returns each span's last hash."""
        k, v = self.kv.k[0][:, 0], self.kv.v[0][:, 0]  # [sessions, context, STATE_BYTES]
        last = rows.last
        first = torch.cat((last[:1] * 0, last[:-1] + 1))
        span = torch.repeat_interleave(torch.arange(len(last), device=last.device), last - first + 1,
                                       output_size=len(rows.tokens))
        step = (rows.tokens + 1) * self.weights[rows.positions]
        run = torch.cumsum(step, 0)
        start = rows.positions[first]
        held = self._int(k[rows.sessions, (start - 1).clamp(min=0)]) * (start > 0)
        h = (held - run[first] + step[first])[span] + run
        session = rows.sessions[span]
        k[session, rows.positions] = self._bytes(h).to(k.dtype)
        v[session, rows.positions] = self._bytes(rows.tokens).to(v.dtype)
        return h[last]

    def _hash_token(self, h: torch.Tensor) -> torch.Tensor:
        z = letter_draw(h)
        token = self.alphabet[(z >> 7) % len(ALPHABET)]
        return torch.where(z % END_ODDS == 0, END, token) if self.rule.ends else token

    def _text_token(self, rows: Batch) -> torch.Tensor:
        """The reply text's next byte after the longest suffix of each span's context that begins it."""
        n = len(self.text) - 1
        at = rows.positions[rows.last][:, None] - n + 1 + torch.arange(n, device=self.device)  # [spans, n]
        tail = self._int(self.kv.v[0][:, 0][rows.sessions[:, None], at.clamp(min=0)])
        tail = torch.where(at >= 0, tail, -1)
        same = (tail[:, self.suffix_at] == self.text[:n]) | ~self.suffix_used  # [spans, k, j]
        matched = (same.all(-1) * torch.arange(1, n + 1, device=self.device)).amax(-1)  # 0: no match
        return self.text[matched]

    def _bytes(self, values: torch.Tensor) -> torch.Tensor:
        return (values[..., None] >> self.shifts) & 0xFF

    def _int(self, stored: torch.Tensor) -> torch.Tensor:
        return (stored.long() << self.shifts).sum(-1)
