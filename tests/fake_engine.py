"""A scripted fake engine speaking the full strata line protocol (engine/protocol.py), for tests.

Run it as the engine program of a run config:

    "engine_command": ["<python>", "tests/fake_engine.py"], "tokenizer": "bytes"

It accepts the engine's command line (`--serve --model X --max-context N --prefill N --batch N
--batch-groups G ...`; unknown flags are ignored) plus the flags below. Every fake flag can also be
given as an environment variable FAKE_<NAME> (e.g. FAKE_TOK_S=0), which is handy through the
config's "env".

  --batch N            run N batch slots (INFO batch_slots=N slot_cache=1), as the real engine
  --batch-groups G     report INFO batch_groups=G (default 1)
  --tok-s R            decode windows per second (solo: tokens/s; batch: one token per active slot
                       per window). 0 = as fast as possible. Default 200.
  --prefill-tok-s R    prompt read speed, tokens/s (0 = instant). Default 0. PP lines per --prefill chunk.
  --startup-s S        seconds before READY (INFO lines come first). Default 0.
  --die-after N        exit (code 3) after emitting N tokens in total (T and BT lines).
  --silent-after N     after N tokens emit nothing more (stays alive, reads stdin).
  --text TEXT          reply with TEXT's UTF-8 bytes, then the end token (byte vocabulary).
  --no-eos             never end a reply by itself: replies run to max_new (finish length).
  --context N          READY context (default: --max-context, else 4096).
  --stats-s S          seconds between STATS lines (default 0.5; 0 = never).
  --dense              STATS without expert-tier figures (a dense model).
  --admission-log F    append one JSON line per GEN/BGEN (kind, slot, prompt length, active slots).

Vocabulary: byte ids 0..255 plus the specials 256 <|im_start|>, 257 <|im_end|> (end of turn, the
reply's last token), 258 <|endoftext|> (the `bytes` tokenizer of server/tokens.py).

Determinism: every generated token is a function of the whole context before it (prompt plus what
was generated), through a rolling hash, like a real language model with greedy decoding. So a
request stopped and continued elsewhere (STOP + BGEN with prompt + generated) goes on with exactly
the tokens it would have produced alone, and `reference_reply(prompt_ids, max_new)` gives the answer
a test must receive. Slots never share state, so requests cannot mix.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.protocol import (  # noqa: E402
    CONTEXT_SLACK,
    BAdm,
    BDone,
    BGen,
    BStop,
    BToken,
    BYield,
    Done,
    Err,
    Gen,
    Info,
    Progress,
    ProtocolError,
    Quit,
    Ready,
    Resume,
    Stats,
    Stop,
    Token,
    Yielded,
    format_reply,
    parse_command,
)

IM_START, IM_END, ENDOFTEXT = 256, 257, 258
EOS = IM_END
ALPHABET = b"abcdefghijklmnopqrstuvwxyz      ,.etaoinshr"
_MASK = (1 << 61) - 1


def roll(h: int, token: int) -> int:
    return (h * 1000003 + token + 1) & _MASK


def context_hash(ids) -> int:
    h = 7
    for t in ids:
        h = roll(h, t)
    return h


def next_token(h: int, no_eos: bool = False) -> int:
    x = ((h ^ (h >> 29)) * 0x9E3779B97F4A7C15) & _MASK
    if not no_eos and x % 47 == 0:
        return EOS
    return ALPHABET[(x >> 11) % len(ALPHABET)]


def text_token(context: list[int], text: bytes) -> int:
    """Next token of a fixed reply: continue after the longest context suffix that starts the text."""
    ids = list(text)
    for k in range(min(len(ids), len(context)), 0, -1):
        if context[-k:] == ids[:k]:
            return ids[k] if k < len(ids) else EOS
    return ids[0] if ids else EOS


def reference_reply(prompt_ids, max_new: int, no_eos: bool = False, text: bytes | None = None) -> tuple[list[int], str]:
    """The tokens (and finish) the fake engine produces for a prompt: what a test must receive."""
    ctx = list(prompt_ids)
    h = context_hash(ctx)
    out: list[int] = []
    while len(out) < max_new:
        t = text_token(ctx, text) if text is not None else next_token(h, no_eos)
        out.append(t)
        ctx.append(t)
        h = roll(h, t)
        if t == EOS:
            return out, "stop"
    return out, "length"


def reference_text(prompt_ids, max_new: int, **kw) -> tuple[str, str]:
    ids, finish = reference_reply(prompt_ids, max_new, **kw)
    return bytes(i for i in ids if i < 256).decode("utf-8", "replace"), finish


# ---------------------------------------------------------------------------------------------


@dataclass
class Job:
    kind: str  # GEN | BGEN
    ids: list[int]
    max_new: int
    slot: int | None = None
    read: int = 0  # prompt tokens read (after the reused part)
    reused: int = 0
    generated: list[int] = field(default_factory=list)
    hash: int = 0
    stop: bool = False
    yield_slot: int | None = None
    t0: float = 0.0
    prompt_ms: float = 0.0
    decode_t0: float = 0.0


@dataclass
class Slot:
    index: int
    held: list[int] = field(default_factory=list)
    active: bool = False
    ctx: list[int] = field(default_factory=list)
    hash: int = 0
    generated: int = 0
    max_new: int = 0
    stop: bool = False
    t0: float = 0.0


def _flag(value, env: str, kind, default):
    if value is not None:
        return value
    raw = os.environ.get("FAKE_" + env)
    return kind(raw) if raw not in (None, "") else default


class FakeEngine:
    def __init__(self, a: argparse.Namespace):
        self.nslots = a.batch or 0
        self.groups = a.batch_groups or 1
        self.tok_s = _flag(a.tok_s, "TOK_S", float, 200.0)
        self.prefill_tok_s = _flag(a.prefill_tok_s, "PREFILL_TOK_S", float, 0.0)
        self.startup_s = _flag(a.startup_s, "STARTUP_S", float, 0.0)
        self.die_after = _flag(a.die_after, "DIE_AFTER", int, 0)
        self.silent_after = _flag(a.silent_after, "SILENT_AFTER", int, 0)
        text = _flag(a.text, "TEXT", str, None)
        self.text = text.encode() if text is not None else None
        self.no_eos = a.no_eos or os.environ.get("FAKE_NO_EOS") == "1"
        self.context = _flag(a.context, "CONTEXT", int, a.max_context or 4096)
        self.chunk = max(1, a.prefill or 512)
        self.stats_s = _flag(a.stats_s, "STATS_S", float, 0.5)
        self.dense = a.dense or os.environ.get("FAKE_DENSE") == "1"
        self.admission_log = _flag(a.admission_log, "ADMISSION_LOG", str, None)
        self.slots = [Slot(i) for i in range(self.nslots)]
        self.solo_cache: list[int] = []
        self.inbox: queue.Queue = queue.Queue()
        self.pending: list = []
        self.job: Job | None = None
        self.emitted = 0
        self.silent = False
        self.eof = False
        self.out = sys.stdout
        self.windows = 0
        self.rows = 0
        self.window_ms_sum = 0.0
        self.last_windows = self.last_rows = 0
        self.slot_tokens: dict[int, int] = {}
        self.prefill_tokens = 0
        self.prefill_ms = 0.0
        self.last_stats = 0.0
        self.tier = {"vram": 0, "pcie": 0, "cpu": 0, "swaps": 0, "adapt_rounds": 0}

    # -- output -------------------------------------------------------------------------------
    def send(self, reply) -> None:
        if self.silent:
            return
        self.out.write(format_reply(reply) + "\n")

    def flush(self) -> None:
        if not self.silent:
            self.out.flush()

    def count_token(self) -> None:
        self.emitted += 1
        if self.die_after and self.emitted >= self.die_after:
            self.flush()
            print("fake engine: CUDA error: an illegal memory access was encountered (die-after)", file=sys.stderr)
            sys.stderr.flush()
            os._exit(3)
        if self.silent_after and self.emitted >= self.silent_after and not self.silent:
            self.flush()
            print("fake engine: going silent (silent-after)", file=sys.stderr, flush=True)
            self.silent = True

    def log(self, msg: str) -> None:
        print(f"fake engine: {msg}", file=sys.stderr, flush=True)

    # -- model --------------------------------------------------------------------------------
    def step_token(self, ctx: list[int], h: int) -> int:
        if self.text is not None:
            return text_token(ctx, self.text)
        return next_token(h, self.no_eos)

    def wait_tok(self) -> None:
        if self.tok_s > 0:
            time.sleep(1.0 / self.tok_s)

    # -- input --------------------------------------------------------------------------------
    def reader(self) -> None:
        for line in sys.stdin:
            self.inbox.put(line)
        self.inbox.put(None)

    def take_commands(self, block: bool) -> None:
        while True:
            try:
                line = self.inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if line is None:
                self.eof = True
                return
            if not line.strip():
                continue
            try:
                cmd = parse_command(line)
            except ProtocolError as exc:
                self.send(Err(str(exc)))
                self.flush()
                continue
            match cmd:
                case Gen() | BGen():
                    self.pending.append(cmd)
                case Stop():
                    if self.job is not None:
                        self.job.stop = True
                case BStop(slot):
                    if 0 <= slot < self.nslots and self.slots[slot].active:
                        self.slots[slot].stop = True
                case BYield(slot):
                    if self.job is not None and 0 <= slot < self.nslots:
                        self.job.yield_slot = slot
                case Quit():
                    self.log("QUIT")
                    self.flush()
                    os._exit(0)

    # -- jobs ---------------------------------------------------------------------------------
    def start_job(self, cmd) -> None:
        ids = list(cmd.ids)
        slot = cmd.slot if isinstance(cmd, BGen) else None
        if slot is not None and not (0 <= slot < self.nslots) or (slot is not None and self.slots[slot].active):
            self.send(Err(f"slot {slot} is not free"))
            return
        if len(ids) + cmd.max_new + CONTEXT_SLACK > self.context:
            self.send(Err(f"prompt ({len(ids)}) + max_new ({cmd.max_new}) + {CONTEXT_SLACK} exceeds the context ({self.context})"))
            return
        job = Job("BGEN" if slot is not None else "GEN", ids, cmd.max_new, slot, t0=time.monotonic())
        cache = self.slots[slot].held if slot is not None else self.solo_cache
        n = 0
        for a, b in zip(cache, ids, strict=False):
            if a != b:
                break
            n += 1
        n = min(n, len(ids) - 1)
        if n > 0:
            job.reused = n
            self.send(Resume(n))
        job.read = n
        job.hash = context_hash(ids)
        self.job = job
        if self.admission_log:
            active = [s.index for s in self.slots if s.active]
            with open(self.admission_log, "a") as fh:
                fh.write(json.dumps({"kind": job.kind, "slot": slot, "prompt": len(ids), "reused": n, "active": active,
                                     "t": time.time()}) + "\n")

    def finish_job(self, finish: str, continues: bool = False) -> None:
        job = self.job
        assert job is not None
        decode_ms = (time.monotonic() - job.decode_t0) * 1000 if job.decode_t0 else 0.0
        ctx = job.ids + job.generated
        self.send(Done(len(job.generated), len(job.ids), job.prompt_ms, decode_ms, finish, reused=job.reused,
                       hits=len(job.generated) * 9, lookups=len(job.generated) * 10))
        if job.kind == "BGEN":
            slot = self.slots[job.slot]
            if continues:
                slot.active, slot.ctx, slot.hash = True, ctx, job.hash
                slot.generated, slot.max_new, slot.stop, slot.t0 = 1, job.max_new, False, time.monotonic()
            else:
                slot.held = ctx[:job.read] if finish == "cancel" and not job.generated else ctx
            self.send(BAdm(job.slot, continues))
        else:
            self.solo_cache = ctx
        self.job = None
        self.flush()

    def step_job(self) -> None:
        job = self.job
        assert job is not None
        if job.read < len(job.ids):  # read one chunk
            if job.stop:
                self.finish_job("cancel")
                return
            n = min(self.chunk, len(job.ids) - job.read)
            t = time.monotonic()
            if self.prefill_tok_s > 0:
                time.sleep(n / self.prefill_tok_s)
            job.read += n
            ms = (time.monotonic() - t) * 1000
            job.prompt_ms += ms
            self.prefill_tokens += n
            self.prefill_ms += ms
            self.send(Progress(job.read, len(job.ids), ms, n / max(ms / 1000, 1e-6)))
            self.flush()
            if job.read < len(job.ids):
                self.take_commands(block=False)
                if job.yield_slot is not None and not job.stop:
                    slot = job.yield_slot
                    self.send(Yielded(slot, job.read))
                    self.slots[slot].held = job.ids[:job.read]
                    self.send(Done(0, len(job.ids), job.prompt_ms, 0.0, "cancel", reused=job.reused))
                    if job.kind == "BGEN":
                        self.send(BAdm(job.slot, False))
                    self.job = None
                    self.flush()
                    return
                if any(s.active for s in self.slots):  # the slots decode between the chunks
                    self.window()
            return
        if job.stop and job.generated:
            self.finish_job("cancel")
            return
        if not job.decode_t0:
            job.decode_t0 = time.monotonic()
        tok = self.step_token(job.ids + job.generated, job.hash)
        job.generated.append(tok)
        job.hash = roll(job.hash, tok)
        self.send(Token(tok))
        self.count_token()
        self.windows += 1
        self.rows += 1
        self.tier["vram"] += 9
        self.tier["cpu"] += 1
        if tok == EOS:
            self.finish_job("stop")
        elif len(job.generated) >= job.max_new:
            self.finish_job("length")
        elif job.kind == "BGEN":
            self.finish_job("length", continues=True)  # the admission's one token; the slot goes on
        else:
            self.flush()
            self.wait_tok()

    def window(self) -> None:
        t = time.monotonic()
        active = [s for s in self.slots if s.active]
        for s in active:
            if s.stop:
                self.end_slot(s, "cancel")
                continue
            tok = self.step_token(s.ctx, s.hash)
            s.ctx.append(tok)
            s.hash = roll(s.hash, tok)
            s.generated += 1
            self.send(BToken(s.index, tok))
            self.count_token()
            if tok == EOS:
                self.end_slot(s, "stop")
            elif s.generated >= s.max_new:
                self.end_slot(s, "length")
        self.flush()
        self.wait_tok()
        self.windows += 1
        self.rows += len(active)
        self.window_ms_sum += (time.monotonic() - t) * 1000
        for s in active:
            self.slot_tokens[s.index] = self.slot_tokens.get(s.index, 0) + 1
        self.tier["vram"] += 9 * len(active)
        self.tier["cpu"] += len(active)

    def end_slot(self, s: Slot, finish: str) -> None:
        s.active = False
        s.held = s.ctx[:-1] if s.ctx else []
        self.send(BDone(s.index, s.generated, finish, (time.monotonic() - s.t0) * 1000))

    def stats(self) -> None:
        """STATS as docs/protocol.md has it: totals since start, rows/window_ms means since the last one."""
        now = time.monotonic()
        if self.stats_s <= 0 or now - self.last_stats < self.stats_s or self.windows == self.last_windows:
            return
        self.last_stats = now
        n = self.windows - self.last_windows
        rows = (self.rows - self.last_rows) / n
        ms = self.window_ms_sum / n
        self.last_windows, self.last_rows, self.window_ms_sum = self.windows, self.rows, 0.0
        used = 0.5 * sum(1 for s in self.slots if s.held or s.active)
        served = self.tier["vram"] + self.tier["cpu"]
        data = {
            "windows": self.windows, "rows": round(rows, 2), "window_ms": round(ms, 3), "tokens": self.rows,
            "slot_tokens": {str(k): v for k, v in self.slot_tokens.items()},
            "prefill_tokens": self.prefill_tokens, "prefill_ms": round(self.prefill_ms, 1),
            "tier": None if self.dense else {
                "mode": "fake", "vram": self.tier["vram"] / served, "pcie": 0.0, "cpu": self.tier["cpu"] / served,
                "hits": self.tier["vram"], "lookups": served, "swaps": self.tier["swaps"],
                "adapt_rounds": self.tier["adapt_rounds"], "adapt_wait_ms": 0.2, "experts_cached": 96,
                "experts_total": 128},
            "memory": [{"device": "cuda:0", "total_mib": 24576, "weights_mib": 14336, "experts_mib": 12288,
                        "slots_mib": 560 * self.nslots, "kv_mib": 256 + used, "free_mib": 8192 - 560 * self.nslots}],
        }
        self.send(Stats(data))
        self.flush()

    def run(self) -> None:
        threading.Thread(target=self.reader, daemon=True).start()
        self.log(f"loading (startup {self.startup_s} s, {self.nslots} slots)")
        info = {"engine": "fake-0.1", "context": self.context, "kv": "fp16", "expert_slots": 96, "pcie_frac": 0,
                "experts": 128, "unsupported": "batch_mtp,adapt_async" + ("" if self.groups > 1 else ",batch_groups")}
        if self.nslots:
            info.update(batch_slots=self.nslots, slot_cache=1, batch_groups=self.groups)
        self.send(Info(info))
        self.flush()
        time.sleep(self.startup_s)
        self.send(Ready(self.context, True))
        self.flush()
        self.log("session is up")
        while True:
            busy = self.job is not None or self.pending or any(s.active for s in self.slots)
            if self.eof and not busy:
                self.log("stdin closed, exiting")
                self.flush()
                os._exit(0)
            self.take_commands(block=not busy and not self.eof)
            if self.silent:
                time.sleep(0.05)
                continue
            if self.job is None and self.pending:
                self.start_job(self.pending.pop(0))
                self.flush()
            if self.job is not None:
                self.step_job()
            elif any(s.active for s in self.slots):
                self.window()
            self.stats()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="fake strata engine for tests")
    p.add_argument("--serve", action="store_true")
    p.add_argument("--model")
    p.add_argument("--max-context", type=int)
    p.add_argument("--prefill", type=int)
    p.add_argument("--batch", "--slots", type=int)
    p.add_argument("--batch-groups", type=int)
    p.add_argument("--tok-s", type=float)
    p.add_argument("--prefill-tok-s", type=float)
    p.add_argument("--startup-s", type=float)
    p.add_argument("--die-after", type=int)
    p.add_argument("--silent-after", type=int)
    p.add_argument("--text")
    p.add_argument("--no-eos", action="store_true")
    p.add_argument("--context", type=int)
    p.add_argument("--stats-s", type=float)
    p.add_argument("--dense", action="store_true")
    p.add_argument("--admission-log")
    args, _unknown = p.parse_known_args(argv)
    FakeEngine(args).run()


if __name__ == "__main__":
    main()
