"""What a request's task hears: the scheduler's `JobEvent`s on `Job.out`, turned by
`streaming.reply_events` into the route's `ReplyEvent`s (text instead of token ids)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.protocol import Logprob
from server.errors import RequestFailed


@dataclass(frozen=True)
class TokenEvent:
    """A token the engine produced for the request (with its log-probabilities when the request asked)."""

    id: int
    logprob: Logprob | None = None


@dataclass(frozen=True)
class ProgressEvent:
    """A prompt chunk was read (`read` of `total` tokens)."""

    read: int
    total: int


@dataclass(frozen=True)
class DoneEvent:
    """The reply is over; `finish`: stop, length, cancel, disconnect (a stop string matched: stop)."""

    finish: str


@dataclass(frozen=True)
class ErrorEvent:
    """The request failed; the error's class says the HTTP status."""

    error: RequestFailed


@dataclass(frozen=True)
class TextEvent:
    """Detokenized text safe to send (what could still become a stop string is held back), and the
    log-probabilities of the reply's tokens taken since the last `TextEvent` (when asked)."""

    text: str
    logprobs: tuple[tuple[int, Logprob], ...] = ()


@dataclass(frozen=True)
class KeepaliveEvent:
    """Nothing to send for a while (or a prompt chunk was read): a comment line keeps the stream open."""


JobEvent = TokenEvent | ProgressEvent | DoneEvent | ErrorEvent
ReplyEvent = TextEvent | KeepaliveEvent | DoneEvent | ErrorEvent
