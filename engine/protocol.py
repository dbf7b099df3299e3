"""The engine's stdin/stdout line grammar, shared by the engine and the server.

One message per line, fields separated by single spaces, token ids always the last field as a
comma-separated list. docs/protocol.md is the human-readable contract; this module is its code.
Everything here is pure: no torch, no I/O.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

FINISH_REASONS = ("stop", "length", "cancel")
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "seed", "repeat_penalty", "presence_penalty",
                 "frequency_penalty", "repeat_last_n", "logprobs")
MAX_SLOTS = 8  # batch slots the engine runs at most (a window holds 8 slot rows, as upstream's)
TOP_K_MAX = 64  # the engine keeps at most this many candidates, as upstream does
CONTEXT_SLACK = 8  # prompt + max_new + CONTEXT_SLACK must fit the context (upstream's rule)
TOP_LOGPROBS_MAX = 20  # alternatives a token's log-probabilities name at most (OpenAI's top_logprobs limit)
# parked conversations by default (--conversation-cache-mib/-slots; docs/config.md says why)
CONVERSATION_CACHE_MIB = 2048
CONVERSATION_CACHE_SLOTS = 8
PREFILL_AUTO_MAX = 8192  # --prefill auto: the largest chunk it picks (upstream's)
VRAM_RESERVE_MIB = 700  # --vram-reserve-mib: VRAM left free beside an automatic expert cache (upstream's default)


class ProtocolError(ValueError):
    """A line that does not follow the grammar; the message is safe to send back as `ERR`."""


# ---------------------------------------------------------------------------------------------
# Requests (server -> engine)


@dataclass(frozen=True)
class Sampling:
    """Per-request sampling keys. The defaults mean greedy decoding without penalties.

    The penalties are llama.cpp's, over the last `repeat_last_n` tokens of the context (prompt and
    generated; -1 = all of it, 0 = none): a token seen there has its logit divided by
    `repeat_penalty` (multiplied when <= 0), then lowered by `presence_penalty` and by
    `frequency_penalty` times its count.

    `logprobs` >= 0 asks for each token's log-probability and the `logprobs` most likely tokens'
    (-1, the default: none); they are the penalized logits' log-softmax, before temperature.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_last_n: int = 64
    logprobs: int = -1

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def penalized(self) -> bool:
        return self.repeat_last_n != 0 and (
            self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0)

    def penalty_window(self, tokens: list[int]) -> list[int]:
        """The tokens the penalties count (none when the request has no penalties)."""
        if not self.penalized:
            return []
        return tokens if self.repeat_last_n < 0 else tokens[-self.repeat_last_n:]

    def validate(self) -> Sampling:
        if not (0.0 <= self.temperature <= 100.0):
            raise ProtocolError(f"temperature must be in [0, 100], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ProtocolError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0 <= self.top_k):
            raise ProtocolError(f"top_k must be >= 0, got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ProtocolError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed < 0:
            raise ProtocolError(f"seed must be >= 0, got {self.seed}")
        if not (0.0 < self.repeat_penalty <= 10.0):
            raise ProtocolError(f"repeat_penalty must be in (0, 10], got {self.repeat_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (-2.0 <= getattr(self, name) <= 2.0):
                raise ProtocolError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.repeat_last_n < -1:
            raise ProtocolError(f"repeat_last_n must be >= -1 (-1 = the whole context), got {self.repeat_last_n}")
        if not (-1 <= self.logprobs <= TOP_LOGPROBS_MAX):
            raise ProtocolError(f"logprobs must be in [-1, {TOP_LOGPROBS_MAX}] (-1 = none), got {self.logprobs}")
        return self

    def to_keys(self) -> list[str]:
        """The `k=v` fields for a request line; defaults are left out, as upstream's server does."""
        keys = []
        if self.temperature > 0:
            keys.append(f"temperature={self.temperature:g}")
        if self.top_p < 1:
            keys.append(f"top_p={self.top_p:g}")
        if self.top_k > 0:
            keys.append(f"top_k={min(self.top_k, TOP_K_MAX)}")
        if self.min_p > 0:
            keys.append(f"min_p={self.min_p:g}")
        if self.seed > 0:
            keys.append(f"seed={self.seed}")
        for name in ("repeat_penalty", "presence_penalty", "frequency_penalty", "repeat_last_n", "logprobs"):
            value = getattr(self, name)
            if value != getattr(Sampling, name):
                keys.append(f"{name}={value:g}")
        return keys


@dataclass(frozen=True)
class Gen:
    max_new: int
    ids: tuple[int, ...]
    sampling: Sampling = Sampling()


@dataclass(frozen=True)
class BGen:
    slot: int
    max_new: int
    ids: tuple[int, ...]
    sampling: Sampling = Sampling()


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Quit:
    pass


@dataclass(frozen=True)
class BStop:
    slot: int


@dataclass(frozen=True)
class BYield:
    slot: int


@dataclass(frozen=True)
class Hold:
    """The admissions that follow are made ready (their slots' conversations parked, their prefixes found) but not
    read until `Go`, so a burst whose requests reach the server one by one is read in one forward."""


@dataclass(frozen=True)
class Go:
    """The held admissions are read (together), and the next ones as they come."""


Command = Gen | BGen | Stop | Quit | BStop | BYield | Hold | Go
BARE = {"STOP": Stop, "QUIT": Quit, "HOLD": Hold, "GO": Go}  # the commands without arguments


def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ProtocolError(f"{what} must be an integer, got {text!r}") from None


def parse_ids(text: str) -> tuple[int, ...]:
    try:
        ids = tuple(map(int, text.split(",")))  # in C: a burst's BGENs are parsed on the engine's way to its read
    except ValueError:
        raise ProtocolError(f"token ids must be comma-separated integers, got {text[:40]!r}") from None
    if min(ids) < 0:  # never empty: an empty field fails int() above
        raise ProtocolError("token ids must be >= 0")
    return ids


def _parse_sampling(parts: list[str]) -> Sampling:
    values: dict[str, Any] = {}
    types = {f.name: f.type for f in fields(Sampling)}
    for part in parts:
        key, eq, value = part.partition("=")
        if not eq or key not in SAMPLING_KEYS:
            raise ProtocolError(f"unknown request key {part!r} (known: {', '.join(SAMPLING_KEYS)})")
        try:
            values[key] = int(value) if types[key] in ("int", int) else float(value)
        except ValueError:
            raise ProtocolError(f"bad value for {key}: {value!r}") from None
    return Sampling(**values).validate()


def _parse_generation(parts: list[str], name: str) -> tuple[int, Sampling, tuple[int, ...]]:
    if len(parts) < 2:
        raise ProtocolError(f"{name} needs <max_new> [k=v ...] <ids>")
    max_new = _int(parts[0], "max_new")
    if max_new < 1:
        raise ProtocolError(f"max_new must be >= 1, got {max_new}")
    ids = parse_ids(parts[-1])
    return max_new, _parse_sampling(parts[1:-1]), ids


def parse_command(line: str) -> Command:
    """Parse one request line. Raises ProtocolError with a message fit for `ERR`."""
    parts = line.split()
    if not parts:
        raise ProtocolError("empty line")
    verb, args = parts[0], parts[1:]
    if verb == "GEN":
        max_new, sampling, ids = _parse_generation(args, "GEN")
        return Gen(max_new, ids, sampling)
    if verb == "BGEN":
        if not args:
            raise ProtocolError("BGEN needs <slot> <max_new> [k=v ...] <ids>")
        slot = _int(args[0], "slot")
        max_new, sampling, ids = _parse_generation(args[1:], "BGEN")
        return BGen(slot, max_new, ids, sampling)
    if verb in BARE and not args:
        return BARE[verb]()
    if verb in ("BSTOP", "BYIELD"):
        if len(args) != 1:
            raise ProtocolError(f"{verb} needs <slot>")
        slot = _int(args[0], "slot")
        return BStop(slot) if verb == "BSTOP" else BYield(slot)
    if verb in BARE:
        raise ProtocolError(f"{verb} takes no arguments")
    raise ProtocolError(f"unknown command {verb!r}")


def format_command(cmd: Command) -> str:
    match cmd:
        case Gen(max_new, ids, sampling):
            return " ".join(["GEN", str(max_new), *sampling.to_keys(), _ids(ids)])
        case BGen(slot, max_new, ids, sampling):
            return " ".join(["BGEN", str(slot), str(max_new), *sampling.to_keys(), _ids(ids)])
        case Stop() | Quit() | Hold() | Go():
            return next(verb for verb, kind in BARE.items() if isinstance(cmd, kind))
        case BStop(slot):
            return f"BSTOP {slot}"
        case BYield(slot):
            return f"BYIELD {slot}"
    raise TypeError(f"not a command: {cmd!r}")


def _ids(ids: tuple[int, ...] | list[int]) -> str:
    return ",".join(str(i) for i in ids)


# ---------------------------------------------------------------------------------------------
# Replies (engine -> server)


@dataclass(frozen=True)
class Info:
    values: dict[str, int | float | str]


@dataclass(frozen=True)
class Ready:
    context: int
    stop: bool = True


@dataclass(frozen=True)
class Resume:
    reused: int


@dataclass(frozen=True)
class Progress:
    read: int
    total: int
    ms: float
    tok_s: float


@dataclass(frozen=True)
class Logprob:
    """A chosen token's log-probability and the most likely tokens' `(id, logprob)`, best first."""

    value: float
    top: tuple[tuple[int, float], ...] = ()

    def fields(self) -> str:
        """` <value> [<id>:<logprob>,...]`: what a `T`/`BT` line carries after the token id."""
        head = f" {self.value:.6g}"
        return head + (" " + ",".join(f"{i}:{lp:.6g}" for i, lp in self.top) if self.top else "")

    @classmethod
    def parse(cls, parts: list[str]) -> Logprob | None:
        if not parts:
            return None
        top = tuple((int(i), float(lp)) for i, _, lp in (t.partition(":") for t in parts[1].split(","))) \
            if len(parts) > 1 else ()
        return cls(float(parts[0]), top)


@dataclass(frozen=True)
class Token:
    id: int
    logprob: Logprob | None = None


@dataclass(frozen=True)
class Done:
    generated: int
    prompt_tokens: int
    prompt_ms: float
    decode_ms: float
    finish: str
    drafts_accepted: int = 0
    drafts_offered: int = 0
    reused: int = 0
    hits: int = 0
    lookups: int = 0
    ram_blobs: int = 0  # upstream's RAM/file expert tiers: always 0 here (every expert is in host RAM)
    file_blobs: int = 0
    file_mb: int = 0
    prompt_read: int = 0
    offloaded: int = 0  # routed entries served over PCIe


@dataclass(frozen=True)
class BAdm:
    slot: int
    continues: bool


@dataclass(frozen=True)
class BToken:
    slot: int
    id: int
    logprob: Logprob | None = None


@dataclass(frozen=True)
class BDone:
    slot: int
    generated: int
    finish: str
    ms: float


@dataclass(frozen=True)
class Yielded:
    slot: int
    tokens: int


@dataclass(frozen=True)
class Err:
    message: str


@dataclass(frozen=True)
class Stats:
    data: dict[str, Any] = field(default_factory=dict)


Reply = Info | Ready | Resume | Progress | Token | Done | BAdm | BToken | BDone | Yielded | Err | Stats

_DONE_OPTIONAL = ("drafts_accepted", "drafts_offered", "reused", "hits", "lookups", "ram_blobs", "file_blobs",
                  "file_mb", "prompt_read", "offloaded")


def _info_value(text: str) -> int | float | str:
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def parse_reply(line: str) -> Reply:
    """Parse one engine output line. Raises ProtocolError for anything unknown."""
    verb, _, rest = line.rstrip("\n").partition(" ")
    p = rest.split()
    try:
        if verb == "T":
            return Token(int(p[0]), Logprob.parse(p[1:]))
        if verb == "BT":
            return BToken(int(p[0]), int(p[1]), Logprob.parse(p[2:]))
        if verb == "PP":
            return Progress(int(p[0]), int(p[1]), float(p[2]), float(p[3]))
        if verb == "DONE":
            extra = {k: int(v) for k, v in zip(_DONE_OPTIONAL, p[5:], strict=False)}
            return Done(int(p[0]), int(p[1]), float(p[2]), float(p[3]), p[4], **extra)
        if verb == "BDONE":
            return BDone(int(p[0]), int(p[1]), p[2], float(p[3]))
        if verb == "BADM":
            return BAdm(int(p[0]), p[1] == "1")
        if verb == "YIELDED":
            return Yielded(int(p[0]), int(p[1]))
        if verb == "RESUME":
            return Resume(int(p[0]))
        if verb == "READY":
            return Ready(int(p[0]), "stop" in p[1:])
        if verb == "INFO":
            pairs = (item.partition("=") for item in p)
            return Info({k: _info_value(v) for k, _, v in pairs})
        if verb == "ERR":
            return Err(rest)
        if verb == "STATS":
            return Stats(json.loads(rest))
    except (IndexError, ValueError) as exc:
        raise ProtocolError(f"malformed {verb} line: {line.strip()[:80]!r}") from exc
    raise ProtocolError(f"unknown reply {verb!r}")


def format_reply(reply: Reply) -> str:
    match reply:
        case Token(i, lp):
            return f"T {i}" + (lp.fields() if lp else "")
        case BToken(slot, i, lp):
            return f"BT {slot} {i}" + (lp.fields() if lp else "")
        case Progress(read, total, ms, tok_s):
            return f"PP {read} {total} {ms:.1f} {tok_s:.1f}"
        case Done():
            head = f"DONE {reply.generated} {reply.prompt_tokens} {reply.prompt_ms:.1f} {reply.decode_ms:.1f} {reply.finish}"
            return head + "".join(f" {getattr(reply, k)}" for k in _DONE_OPTIONAL)
        case BDone(slot, generated, finish, ms):
            return f"BDONE {slot} {generated} {finish} {ms:.1f}"
        case BAdm(slot, continues):
            return f"BADM {slot} {int(continues)}"
        case Yielded(slot, tokens):
            return f"YIELDED {slot} {tokens}"
        case Resume(n):
            return f"RESUME {n}"
        case Ready(ctx, stop):
            return f"READY {ctx}" + (" stop" if stop else "")
        case Info(values):
            return "INFO " + " ".join(f"{k}={_info_text(v)}" for k, v in values.items())
        case Err(message):
            return "ERR " + " ".join(message.split())
        case Stats(data):
            return "STATS " + json.dumps(data, separators=(",", ":"))
    raise TypeError(f"not a reply: {reply!r}")


def _info_text(value: int | float | str) -> str:
    text = f"{value:g}" if isinstance(value, float) else str(value)
    return text.replace(" ", "_") or "-"
