"""Sessions over one model: prompt reads in chunks, decode windows, prefix reuse between sessions.

Session `n_slots` is the solo session; sessions 0..n_slots-1 are the batch slots. A session holds
tokens whose KV is in its cache rows; any prefix of them can be reused by a later read, in place or
copied into another session. With a parking store (engine/parking.py) a conversation a read is about
to overwrite is parked in host memory first, and a read can continue a parked one as a live one.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.batch import BatchBuilder, Span, to_device
from engine.cpu_plans import DecodePlans
from engine.cuda_graphs import DecodeGraphs
from engine.experts import ExpertStats
from engine.kernels import cpu as cpu_kernels
from engine.loading import log
from engine.models.base import Model
from engine.parking import ParkingStore, common_prefix, continues
from engine.protocol import Sampling
from engine.sampling import Draw, choose, sample_rows
from engine.weights import MATVEC_ROWS

if TYPE_CHECKING:
    from engine.tier.tier import Counted


@dataclass
class Session:
    index: int
    tokens: list[int] = field(default_factory=list)
    turn: int = 0  # the length of the prompt last read into it (its turn checkpoint)


@dataclass(frozen=True)
class Row:
    """One row of a decode step: `session` is fed `token` (`AHEAD`: the token the window queued before
    chose for it, still on the device), then draws its next token."""

    session: Session
    token: int
    sampling: Sampling
    seed: int


AHEAD = -1


@dataclass
class Queued:
    """A decode window handed to the device: its rows, their chosen tokens (`chosen`, on the device) on
    their way to the host, and the routed entries it served."""

    rows: list[Row]
    chosen: torch.Tensor
    experts: ExpertStats = field(default_factory=ExpertStats)
    _host: torch.Tensor | list[int] | None = None
    _copied: torch.cuda.Event | None = None
    # with an expert tier: its counts before and after this window, until `Runner.finish` counts them
    _counted: tuple[Counted, Counted] | None = None

    def tokens(self) -> list[int]:
        """The chosen tokens, once the device has them (the only wait for this window)."""
        if self._copied is not None:
            self._copied.synchronize()
        return self._host if isinstance(self._host, list) else self._host.tolist()


class Runner:
    """`groups`: the slots in that many groups of consecutive slots (`--batch-groups`), each decoded in
    its own window; the solo session goes with the last group. `graphs`: decode windows replayed from
    CUDA graphs where the model allows (engine/cuda_graphs.py); `plans`: from CPU plans
    (engine/cpu_plans.py)."""

    def __init__(self, model: Model, n_slots: int, exact: bool, groups: int = 1, graphs: bool = True,
                 ahead: bool | None = None, plans: bool = True):
        if groups < 1 or (n_slots and n_slots % groups):
            raise ValueError(f"{groups} groups do not divide {n_slots} slots")
        self.model = model
        self.exact = exact
        self.groups = groups
        self.group_size = max(1, n_slots // groups)
        self.sessions = [Session(i) for i in range(n_slots + 1)]
        self.batches = BatchBuilder(model.device, max(model.kv.max_chunk, n_slots + 1), n_slots + 1)
        self.chunk = model.kv.max_chunk  # the rows a prompt forward takes at most (`read`): --prefill
        cpu_kernels.set_threads(torch.get_num_threads())
        self.graphs = DecodeGraphs(model) if graphs and DecodeGraphs.usable(model) else None
        self.plans = DecodePlans(model) if plans and DecodePlans.usable(model) else None
        # windows queued on the last one's tokens before the host reads them (`queue`): where the device
        # runs apart from the host (None: on CUDA)
        self.ahead = model.device.type == "cuda" if ahead is None else ahead
        self.queued_ahead = 0  # windows queued on the last one's tokens

    @property
    def solo(self) -> Session:
        return self.sessions[-1]

    def slot(self, index: int) -> Session:
        return self.sessions[index]

    def reuse(self, target: Session, prompt: list[int], busy: set[int], parking: ParkingStore | None = None) -> int:
        """Give `target` the longest held prefix of `prompt` found in any session not in `busy`, or
        parked in `parking`; first park the conversation `target` holds unless `prompt` continues it
        or another session holds it too.

        The prompt's last token is always left to read (its logits choose the first new token).
        Returns the number of tokens reused.
        """
        best, best_n = target, self.usable(target, prompt)
        for s in self.sessions:
            if s.index in busy or s is target:
                continue
            n = self.usable(s, prompt)
            if n > best_n:
                best, best_n = s, n
        entry, entry_n = parking.best(lambda held: self.usable_tokens(held, prompt)) if parking else (None, 0)
        restoring = entry is not None and entry_n > best_n
        if restoring:
            parking.take(entry)
        if parking is not None:
            self._park(target, prompt, parking)
        if restoring:
            parking.restore(entry, self.model.kv, target.index, entry_n)
            if not continues(entry.tokens, entry.turn, prompt):
                parking.put(entry)  # only a prefix was used (a shared system prompt): it stays parked
            n = entry_n
        else:
            n = best_n
            if best is not target and n:
                t0 = time.perf_counter()
                self.model.kv.copy(best.index, target.index, n)
                log(f"reuse: {n} tokens copied from {self.name(best)} to {self.name(target)} "
                    f"in {(time.perf_counter() - t0) * 1000:.1f} ms")
        target.tokens = prompt[:n]
        target.turn = len(prompt)
        return n

    def forget(self) -> None:
        """Empty every session after reads and windows that only measure or warm (`prefill.read_peak`,
        `warmup`), and make an expert tier forget their routing and give back the slots a read borrowed."""
        for session in self.sessions:
            session.tokens, session.turn = [], 0
        tier = self.model.tier
        if tier is not None:
            tier.repay()
            for layer in tier.layers:
                layer.reset_counts()

    def park_ahead(self, parking: ParkingStore) -> bool:
        """While the engine is idle: take the copy of one session's conversation that a read overwriting the session
        would park (`ParkingStore.park_ahead`). Returns whether one was taken (the caller looks at its commands before
        the next)."""
        return any(s.tokens and not self._held_elsewhere(s)
                   and parking.park_ahead(self.model.kv, s.index, s.tokens, s.turn) for s in self.sessions)

    def _park(self, target: Session, prompt: list[int], parking: ParkingStore) -> None:
        """Park `target`'s conversation if this read loses it and no other session holds it; else drop a copy of it
        taken ahead."""
        held = target.tokens
        if held and not continues(held, target.turn, prompt) and not self._held_elsewhere(target):
            parking.park(self.model.kv, target.index, held, target.turn)
        else:
            parking.drop_ready(target.index)

    def _held_elsewhere(self, target: Session) -> bool:
        """Whether another session holds all of `target`'s conversation."""
        return any(s is not target and common_prefix(s.tokens, target.tokens) == len(target.tokens)
                   for s in self.sessions)

    def usable(self, session: Session, prompt: list[int]) -> int:
        """How much of `prompt` a read can continue from `session`'s cache."""
        return self.usable_tokens(session.tokens, prompt)

    def usable_tokens(self, held: list[int], prompt: list[int]) -> int:
        """How much of `prompt` a read can continue from a cache that wrote `held` (live or parked)."""
        return self.model.kv.usable_prefix(len(held), common_prefix(held, prompt[:-1]))

    def name(self, session: Session) -> str:
        return "the solo session" if session is self.solo else f"slot {session.index}"

    def copy(self, src: Session, dst: Session, parking: ParkingStore | None = None) -> None:
        """`src`'s conversation into `dst` (a read that gives way), parking `dst`'s as `reuse` would."""
        if parking is not None:
            self._park(dst, src.tokens, parking)
        self.model.kv.copy(src.index, dst.index, len(src.tokens))
        dst.tokens, dst.turn = list(src.tokens), src.turn

    @torch.inference_mode()
    def forward(self, spans: list[Span], tokens: list[int], fed: torch.Tensor | None = None,
                read_at_once: bool = False) -> torch.Tensor:
        """One forward pass; float32 logits of each span's last row, [len(spans), vocab]. `fed`: the
        rows' tokens on the device, in place of `tokens`. `read_at_once`: the caller reads the logits before
        the next forward, so a CPU plan may hand out its own output instead of a copy."""
        batch = self.batches.build(spans, tokens)
        if fed is not None:
            batch.tokens.copy_(fed)
        logits = self.graphs.run(batch) if self.graphs is not None else None
        if logits is not None:
            return logits
        with self._torch_threads(len(tokens)):
            logits = self.plans.run(batch, copy=not read_at_once) if self.plans is not None else None
            return logits if logits is not None else self.model.logits(self.model.forward(batch))

    @contextmanager
    def _torch_threads(self, rows: int) -> Iterator[None]:
        """A decode step on the CPU runs torch's small ops on one thread: each op's fork and join
        costs more than its arithmetic, and far more when another program holds a core (demo, 2
        cores, one busy: 5.2 -> 8.2 tok/s from this alone). The block kernels keep every thread
        (`cpu_kernels.set_threads` at start); prompt chunks keep torch's threads for their GEMMs."""
        if self.model.device.type != "cpu" or rows > MATVEC_ROWS:
            yield
            return
        n = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(n)

    def read(self, session: Session, ids: list[int]) -> torch.Tensor:
        """Feed prompt tokens into `session` (in forwards of at most `chunk` rows); returns the logits
        after the last one, [vocab]."""
        for lo in range(0, len(ids), self.chunk):
            logits = self.read_parts([(session, ids[lo : lo + self.chunk])])
        return logits[0]

    def read_parts(self, parts: list[tuple[Session, list[int]]]) -> torch.Tensor:
        """One forward over prompt tokens of several sessions (at most `chunk` in all), each fed its own;
        returns the logits after each one's last token, [len(parts), vocab]."""
        spans = [Span(session.index, len(session.tokens), len(ids)) for session, ids in parts]
        if sum(span.length for span in spans) > self.chunk:
            raise ValueError(f"a forward takes at most {self.chunk} prompt tokens")
        logits = self.forward(spans, [t for _, ids in parts for t in ids])
        for session, ids in parts:
            session.tokens.extend(ids)
        return logits

    def sample(self, logits: torch.Tensor, draws: list[Draw]) -> list[int]:
        """Each row's next token (logits [rows, vocab]), read back to the host once."""
        return sample_rows(logits, draws)

    def group_of(self, session: Session) -> int:
        return min(session.index // self.group_size, self.groups - 1)

    def decode_window(self, rows: list[Row]) -> tuple[list[int], ExpertStats]:
        """`decode` as a decode window of the engine: the routed entries it served, counted, and the expert
        tier (when there is one) told of the window, so that it adapts."""
        window = self.queue(rows)
        tokens = window.tokens()
        return tokens, self.finish(window)

    def decode(self, rows: list[Row]) -> list[int]:
        """One decode step: every row feeds its token, then samples its next one.

        Exact mode computes every row with the arithmetic of a step of one, so a row's result does
        not depend on the other rows; otherwise the rows of a group share each matrix product. The
        groups' windows are issued one after the other and sampled together at the end: on a layer
        split over GPUs nothing waits for the host in between, so stage k works on one group's window
        while stage k + 1 works on the one before.
        """
        return self._launch(rows).tokens()

    def can_queue_ahead(self, rows: list[Row]) -> bool:
        """Whether the next window of `rows` can be queued on this one's tokens before the host reads
        them: one forward a window on one device (no exact rows apart, no groups, no layer split), nothing
        in it that needs the tokens on the host (penalties, log-probabilities), an expert tier only where no
        layer syncs the host in a window (`Tier.can_queue_ahead`), and only full-attention caches (a row that
        stops has been fed one token past its end: a ring would lose a position it still holds)."""
        tier = self.model.tier
        return (self.ahead and (tier is None or tier.can_queue_ahead(len(rows))) and self.groups == 1
                and not (self.exact and len(rows) > 1)
                and not self.model.kv.rings and not self.model.placement.split
                and all(r.sampling.logprobs < 0 and not r.sampling.penalized for r in rows))

    def queue(self, rows: list[Row], after: Queued | None = None) -> Queued:
        """`decode_window` without reading the tokens back: the loop reads them with `Queued.tokens`. With
        `after`, the rows (a subset of its rows, `can_queue_ahead`) feed the tokens it chose: the device
        runs this window while the host reads that one's tokens. The caller appends each such token to
        its session once read (unless the row stopped there)."""
        if after is not None and not self.can_queue_ahead(rows):
            raise ValueError("these rows cannot be queued ahead (Runner.can_queue_ahead)")
        tier = self.model.tier
        if tier is not None:  # its counts are read back without waiting; `finish` counts the window
            before = tier.window_start()
            window = self._launch(rows, after)
            window._counted = (before, tier.counted())
        else:
            before_stats = self.model.expert_stats()
            window = self._launch(rows, after)
            window.experts = self.model.expert_stats() - before_stats
        self.queued_ahead += after is not None
        return window

    def finish(self, window: Queued) -> ExpertStats:
        """After a queued window's tokens were read: the routed entries it served, and with an expert tier the
        window counted there (`Tier.window_done`: its adaptation may run a round)."""
        if window._counted is not None:
            window.experts = self.model.tier.window_done(*window._counted)
            window._counted = None
        return window.experts

    def _launch(self, rows: list[Row], after: Queued | None = None) -> Queued:
        spans = [Span(r.session.index, len(r.session.tokens), 1) for r in rows]
        tokens = [max(r.token, 0) for r in rows]
        if after is None:
            if any(r.token == AHEAD for r in rows):
                raise ValueError("a row fed the token a window queued before chose needs that window (after=)")
            fed = None
        elif [r.session for r in rows] == [r.session for r in after.rows]:
            fed = after.chosen
        else:
            at = {id(r.session): i for i, r in enumerate(after.rows)}
            fed = after.chosen[to_device([at[id(r.session)] for r in rows], torch.int64, after.chosen.device)]
        if self.exact and len(rows) > 1:
            logits = torch.cat([self.forward([span], [token]) for span, token in zip(spans, tokens, strict=True)])
        elif self.groups > 1:
            logits = self._group_windows(rows, spans, tokens)
        else:
            logits = self.forward(spans, tokens, fed, read_at_once=True)  # sampled below
        draws = []
        for r, span in zip(rows, spans, strict=True):
            if r.token == AHEAD:  # its token is not on the host yet: no penalties (`can_queue_ahead`)
                draws.append(Draw(r.sampling, r.seed, span.start + 1))
            else:
                r.session.tokens.append(r.token)
                draws.append(Draw.after(r.sampling, r.seed, r.session.tokens))
        if any(d.sampling.logprobs >= 0 for d in draws):
            picks = self.sample(logits, draws)
            return Queued(rows, torch.tensor(picks, device=logits.device), _host=picks)
        chosen = choose(logits, draws)
        if chosen.device.type != "cuda":
            return Queued(rows, chosen, _host=chosen)
        host = torch.empty(chosen.shape, dtype=chosen.dtype, pin_memory=True)
        host.copy_(chosen, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return Queued(rows, chosen, _host=host, _copied=copied)

    def _group_windows(self, rows: list[Row], spans: list[Span], tokens: list[int]) -> torch.Tensor:
        """One forward per group with rows; the logits in the rows' order."""
        members: dict[int, list[int]] = {}
        for j, r in enumerate(rows):
            members.setdefault(self.group_of(r.session), []).append(j)
        pieces: list[torch.Tensor] = [torch.empty(0)] * len(rows)
        for group in sorted(members):
            js = members[group]
            logits = self.forward([spans[j] for j in js], [tokens[j] for j in js])
            for k, j in enumerate(js):
                pieces[j] = logits[k : k + 1]
        return torch.cat(pieces)
