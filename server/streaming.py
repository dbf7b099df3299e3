"""From engine tokens to client text: detokenizing, stop strings, SSE framing and disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from engine.protocol import Logprob
from server.events import (
    DoneEvent,
    ErrorEvent,
    KeepaliveEvent,
    ProgressEvent,
    ReplyEvent,
    TextEvent,
    TokenEvent,
)
from server.scheduler import Job
from server.tokens import TokenizerLike

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class TextAssembler:
    """Detokenizes a reply and holds back what could still become a stop string.

    `push` returns the text that is safe to send; after a stop string matched, `stopped` is True
    and the text ends just before it (the stop string itself is never sent).
    """

    def __init__(self, tokenizer: TokenizerLike, stops: list[str]):
        self._decoder = tokenizer.stream_decoder()
        self.skip = tokenizer.stop_ids  # end tokens: no text, and no entry in logprobs
        self.stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.sent = 0
        self.stopped = False
        self.tokens = 0  # tokens that count toward the reply (up to the stop)

    def push(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self.tokens += 1
        if token_id in self.skip:
            return ""
        piece = self._decoder.push(token_id)
        if not piece:
            return ""
        return self._add(piece, final=False)

    def finish(self) -> str:
        if self.stopped:
            return ""
        return self._add(self._decoder.flush(), final=True)

    def _add(self, piece: str, final: bool) -> str:
        start = max(0, len(self.text) - self._hold)
        self.text += piece
        if self.stops:
            cut = -1
            for s in self.stops:
                i = self.text.find(s, start)
                if i >= 0 and (cut < 0 or i < cut):
                    cut = i
            if cut >= 0:
                self.text = self.text[:cut]
                self.stopped = True
                out = self.text[self.sent:]
                self.sent = len(self.text)
                return out
        safe = len(self.text) if final else max(self.sent, len(self.text) - self._hold)
        out = self.text[self.sent:safe]
        self.sent = safe
        return out


async def reply_events(job: Job, assembler: TextAssembler, on_stop: Callable[[], None],
                       keepalive_s: float) -> AsyncIterator[ReplyEvent]:
    """The job's events as text: `TextEvent`s, `KeepaliveEvent`s, then one `DoneEvent` (finish "stop"
    when a stop string matched) or `ErrorEvent`.

    Tokens that are already queued are taken together, so a busy server sends fewer, larger chunks.
    """
    out = job.out
    while True:
        try:
            ev = await asyncio.wait_for(out.get(), keepalive_s) if out.empty() else out.get_nowait()
        except TimeoutError:
            yield KeepaliveEvent()
            continue
        text: list[str] = []
        logprobs: list[tuple[int, Logprob]] = []
        progressed = False
        end: DoneEvent | ErrorEvent | None = None
        while True:
            match ev:
                case TokenEvent(token, logprob):
                    if not assembler.stopped:
                        if logprob is not None and token not in assembler.skip:
                            logprobs.append((token, logprob))
                        text.append(assembler.push(token))
                        if assembler.stopped:
                            on_stop()
                case ProgressEvent():
                    progressed = True
                case DoneEvent(finish):
                    text.append(assembler.finish())
                    end = DoneEvent("stop" if assembler.stopped else finish)
                case ErrorEvent():
                    end = ev
            if end is not None or out.empty():
                break
            ev = out.get_nowait()
        joined = "".join(text)
        if joined or logprobs:
            yield TextEvent(joined, tuple(logprobs))
        elif progressed:
            yield KeepaliveEvent()
        if end is not None:
            yield end
            return


def sse(data: dict[str, Any] | str) -> bytes:
    if isinstance(data, str):
        return f"data: {data}\n\n".encode()
    return b"data: " + json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


KEEPALIVE = b": keep-alive\n\n"


class SSEResponse:
    """A hand-rolled text/event-stream ASGI response that notices a client leaving at once.

    A task listens for `http.disconnect` while the body is produced; `on_disconnect` is called when the
    client goes (or a write fails), and the producer is then drained so the job's lines are read.
    """

    def __init__(self, body: AsyncIterator[bytes], on_disconnect: Callable[[], None]):
        self.body = body
        self.on_disconnect = on_disconnect

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        gone = False

        async def listen() -> None:
            nonlocal gone
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    gone = True
                    self.on_disconnect()
                    return

        listener = asyncio.create_task(listen())
        try:
            async for chunk in self.body:
                if gone:
                    continue
                try:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                except OSError:
                    gone = True
                    self.on_disconnect()
            if not gone:
                with contextlib.suppress(OSError):
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener
