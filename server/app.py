"""The HTTP routes: OpenAI API, /health, /v1/status, /metrics (JSON and Prometheus)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.chat_template import ChatTemplate
from engine.protocol import Logprob
from server import chat_page
from server import openai_api as api
from server.access_log import AccessLog
from server.auth import Guard
from server.chat_prompt import render_chat
from server.config import RunConfig
from server.engine_client import EngineDied, EngineLaunch, default_log_path, say
from server.errors import RequestFailed
from server.events import DoneEvent, ErrorEvent, KeepaliveEvent, ReplyEvent, TextEvent
from server.metrics import Metrics
from server.metrics_schema import Activity, Concurrency, StatusView, Timings
from server.openai_api import ApiError
from server.reply_parser import Piece, ReplyParser
from server.scheduler import Job, Scheduler
from server.streaming import KEEPALIVE, SSEResponse, TextAssembler, reply_events, sse
from server.tokens import BatchEncoder, TokenizerLike, load_vocabulary
from server.tool_calls import ToolCall
from server.urls import api_url, server_url


class ServerState:
    def __init__(self, config: RunConfig, config_path: str | None, api_key: str | None, log_path: Path | None):
        self.config = config
        self.api_key = api_key
        self.started = time.time()
        self.metrics = Metrics(config, config_path)
        launch = EngineLaunch(config.engine_command_line(), config.engine_env(),
                              log_path or default_log_path(config.log, config.served_name),
                              config.engine_silence_s, config.prefill_most)
        self.scheduler = Scheduler(launch, config.queue_limit, on_finish=self._finished,
                                   on_tokens=self.metrics.on_tokens, on_stats=self.metrics.on_stats)
        self.supervisor = self.scheduler.sup
        self.tokenizer: TokenizerLike | None = None
        self.encoder: BatchEncoder | None = None
        self.template: ChatTemplate | None = None
        self.vocab_error: str | None = None
        self.requests = 0
        self.last_request_at: float | None = None
        self.last_timings: dict[str, Any] | None = None
        self._boot: asyncio.Task | None = None

    def _finished(self, job: Job) -> None:
        self.metrics.on_finish(job)
        if job.finish != "error":
            self.last_timings = api.timings(job)

    def job_summary(self, job: Job) -> str:
        """The tokens part of a completion's request line (server/access_log.py)."""
        row = next((r for r in itertools.islice(self.metrics.rows, 16) if r.id == job.id), None)
        if row is None:  # the client left before the engine finished: what it got so far
            return f"prompt {len(job.prompt)}, out {len(job.generated)} so far"
        where = row.path + (f" {row.slot}" if row.slot is not None and "slot" in row.path else "")
        return (f"prompt {row.prompt_tokens} ({row.reused} reused), out {row.output_tokens} "
                f"({row.decode_tok_s:.1f} tok/s, {row.finish}, {where})")

    async def boot(self) -> None:
        try:
            self.tokenizer, self.template = await asyncio.to_thread(
                load_vocabulary, self.config.model, self.config.tokenizer)
            self.encoder = BatchEncoder(self.tokenizer)
        except Exception as exc:  # reported by /health and every request
            self.vocab_error = f"cannot read the model's vocabulary: {exc}"
            say(self.vocab_error)
        with contextlib.suppress(EngineDied):
            await self.supervisor.ensure_ready()
            say(f"ready: {api_url(server_url(self.config.host, self.config.port))} (model {self.config.served_name})")

    @property
    def context(self) -> int:
        eng = self.supervisor.engine
        return eng.context if eng is not None and eng.context else self.config.context


# ---------------------------------------------------------------------------------------------
# helpers


def _state(request: Request) -> ServerState:
    return request.app.state.strata


def error(status: int, message: str, param: str | None = None, code: str | None = None,
          headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(api.error_body(status, message, param, code), status_code=status, headers=headers)


async def read_body(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the request body is larger than {limit} bytes (max_body_bytes)",
                               code="body_too_large")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ApiError(400, "the client went away while sending the body") from None
    return b"".join(chunks)


def _check_ready(st: ServerState) -> None:
    if st.vocab_error:
        raise ApiError(503, st.vocab_error, code="model_unavailable")
    if st.tokenizer is None or st.supervisor.state == "starting":
        raise ApiError(503, "the model is loading; try again shortly", code="loading")


async def _encode(st: ServerState, text: str) -> list[int]:
    assert st.encoder is not None
    ids = await st.encoder.encode(text)  # off the event loop, a burst's prompts together
    if not ids:
        raise ApiError(400, "the prompt is empty", param="prompt")
    return ids


async def _prompt(st: ServerState, body: Any, chat: bool) -> tuple[list[int], ReplyParser | None]:
    """The prompt's tokens, and for a chat the parser of its reply."""
    if chat:
        prompt = render_chat(body, st.template)
        return await _encode(st, prompt.text), prompt.parser()
    if isinstance(body.prompt, list) and isinstance(body.prompt[0], int):
        return list(body.prompt), None
    return await _encode(st, body.prompt[0] if isinstance(body.prompt, list) else body.prompt), None


async def _wait_disconnect(receive: Any) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


# ---------------------------------------------------------------------------------------------
# routes


async def health(request: Request) -> JSONResponse:
    st = _state(request)
    sup = st.supervisor
    base = {"service": "strata-desk", "model": st.config.served_name, "api_key": bool(st.api_key)}
    if st.vocab_error:
        return JSONResponse({**base, "status": "error", "error": st.vocab_error}, status_code=503)
    if sup.ready and st.tokenizer is not None:
        return JSONResponse({**base, "status": "ok", "loaded": True, "max_context": st.context})
    if sup.state == "dead":
        return JSONResponse({**base, "status": "error", "loaded": False, "error": sup.last_error,
                             "note": "the next request starts the engine again"}, status_code=503)
    eng = sup.engine
    elapsed = round(time.time() - eng.started_at, 1) if eng is not None else 0.0
    return JSONResponse({**base, "status": "loading", "loaded": False, "elapsed_s": elapsed}, status_code=503)


async def models(request: Request) -> JSONResponse:
    st = _state(request)
    return JSONResponse({"object": "list", "data": [{
        "id": st.config.served_name, "object": "model", "created": int(st.started), "owned_by": "strata-desk",
        "meta": {"n_ctx": st.context}}]})


async def status(request: Request) -> JSONResponse:
    st = _state(request)
    sup, sch = st.supervisor, st.scheduler
    eng = sup.engine
    view = StatusView(
        model=st.config.served_name, loaded=sup.ready,
        engine=str(eng.info.get("engine")) if eng is not None and "engine" in eng.info else None,
        started=st.started, uptime_s=round(time.time() - st.started, 3),
        context={"max_positions": st.context, "configured": st.config.context},
        concurrency=Concurrency(serving=max(1, sch.nslots), requested=st.config.parallel),
        activity=Activity(requests=st.requests, in_flight=len(sch.running), queued=len(sch.waiting),
                          last_request_at=st.last_request_at),
        last_timings=Timings(**st.last_timings) if st.last_timings else None)
    return JSONResponse(view.model_dump(mode="json"))


async def metrics_json(request: Request) -> Response:
    st = _state(request)
    snap = st.metrics.snapshot(st.scheduler, all_requests=request.query_params.get("requests") == "all")
    return Response(snap.model_dump_json(), media_type="application/json")


async def metrics_prometheus(request: Request) -> Response:
    st = _state(request)
    return Response(st.metrics.prometheus(st.scheduler), media_type="text/plain; version=0.0.4; charset=utf-8")


async def chat_completions(request: Request) -> Response:
    return await _generate(request, chat=True)


async def completions(request: Request) -> Response:
    return await _generate(request, chat=False)


async def _generate(request: Request, chat: bool) -> Response:
    st = _state(request)
    try:
        with st.scheduler.arriving():
            raw = await read_body(request, st.config.max_body_bytes)
            body = api.parse_body(raw, api.ChatRequest if chat else api.CompletionRequest)
            _check_ready(st)
            ids, parser = await _prompt(st, body, chat)
            asked = body.max_completion_tokens if chat and body.max_completion_tokens is not None else body.max_tokens
            max_new = api.budget(len(ids), asked, st.context, st.config.sampling.max_tokens)
            sampling = api.sampling_of(body, st.config.sampling)
            job = Job(ids, max_new, sampling, endpoint="chat" if chat else "completions")
        request.state.summary = lambda: st.job_summary(job)
        try:
            st.scheduler.submit(job)
        except RequestFailed as exc:
            raise ApiError(exc.status, str(exc), code=exc.code) from None
    except ApiError as exc:
        headers = {"Retry-After": "2"} if exc.status == 503 else None
        return error(exc.status, exc.message, exc.param, exc.code, headers)
    st.requests += 1
    st.last_request_at = time.time()
    assembler = TextAssembler(st.tokenizer, body.stop_list())  # type: ignore[arg-type]
    prefix = "chatcmpl-" if chat else "cmpl-"
    cid = prefix + uuid.uuid4().hex[:24]
    model = st.config.served_name

    def on_stop() -> None:
        st.scheduler.cancel(job, "stop")

    events = reply_events(job, assembler, on_stop, st.config.keepalive_s)
    if body.stream:
        gen = _stream(cid, model, parser, job, assembler, events, body.include_usage(),
                      st.tokenizer.token_bytes)  # type: ignore[union-attr]
        return SSEResponse(gen, lambda: st.scheduler.cancel(job, "disconnect"))  # type: ignore[return-value]
    return await _collect(request, st, cid, model, parser, job, assembler, events)


def _usage(job: Job, assembler: TextAssembler) -> dict[str, Any]:
    n = assembler.tokens if assembler.stopped else len(job.generated)
    return api.usage(len(job.prompt), n, job.reused)


async def _collect(request: Request, st: ServerState, cid: str, model: str, parser: ReplyParser | None, job: Job,
                   assembler: TextAssembler, events: AsyncIterator[ReplyEvent]) -> Response:
    """One JSON body; `parser` None: a completion's plain text."""
    parts: list[str] = []
    logprobs: list[tuple[int, Logprob]] = []
    end: DoneEvent | ErrorEvent | None = None

    async def consume() -> None:
        nonlocal end
        async for ev in events:
            if isinstance(ev, TextEvent):
                parts.append(ev.text)
                logprobs.extend(ev.logprobs)
            elif isinstance(ev, DoneEvent | ErrorEvent):
                end = ev

    work = asyncio.create_task(consume())
    gone = asyncio.create_task(_wait_disconnect(request.receive))
    await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    if not work.done():  # the client left: stop the job, let its lines drain
        st.scheduler.cancel(job, "disconnect")
        await work
    gone.cancel()
    assert end is not None
    if isinstance(end, ErrorEvent):
        return error(end.error.status, str(end.error), code=end.error.code)
    text = "".join(parts)
    use, tim = _usage(job, assembler), api.timings(job)
    if parser is None:
        return JSONResponse(api.completion_response(cid, model, text, api.finish_reason(end.finish), use, tim))
    message = api.chat_message(parser.feed(text) + parser.finish())
    finish = api.finish_reason(end.finish, called="tool_calls" in message)
    asked = job.sampling.logprobs >= 0
    content = api.logprobs_content(logprobs, st.tokenizer.token_bytes) if asked else None  # type: ignore[union-attr]
    return JSONResponse(api.chat_response(cid, model, message, finish, use, tim, content))


async def _stream(cid: str, model: str, parser: ReplyParser | None, job: Job, assembler: TextAssembler,
                  events: AsyncIterator[ReplyEvent], include_usage: bool,
                  spell: Callable[[int], bytes]) -> AsyncIterator[bytes]:
    """SSE chunks; `parser` None: a completion's plain text. Tokens' logprobs (when asked) ride on the
    next chunk sent, the finish chunk at the latest."""
    created = int(time.time())
    called = False
    pending: list[tuple[int, Logprob]] = []

    def with_logprobs(chunk: dict[str, Any]) -> dict[str, Any]:
        if pending:
            chunk["choices"][0]["logprobs"] = api.logprobs_content(pending, spell)
            pending.clear()
        return chunk

    def chunks(pieces: list[Piece]) -> list[bytes]:
        nonlocal called
        called |= any(isinstance(p, ToolCall) for p in pieces)
        return [sse(with_logprobs(api.chat_chunk(cid, created, model, api.chat_delta(p)))) for p in pieces]

    if parser is not None:
        yield sse(api.chat_chunk(cid, created, model, {"role": "assistant", "content": ""}))
    async for ev in events:
        match ev:
            case TextEvent(text) if parser is None:
                yield sse(api.completion_chunk(cid, created, model, text))
            case TextEvent(text, logprobs):
                pending.extend(logprobs)
                for chunk in chunks(parser.feed(text)):
                    yield chunk
            case KeepaliveEvent():
                yield KEEPALIVE
            case ErrorEvent(failure):
                yield sse(api.error_body(failure.status, str(failure), None, failure.code))
                yield sse("[DONE]")
                return
            case DoneEvent(finish):
                # the last events in one write: a burst's streams end together, one after another in this loop
                if parser is None:
                    tail = []
                    last = api.completion_chunk(cid, created, model, "", api.finish_reason(finish))
                else:
                    tail = chunks(parser.finish())
                    last = with_logprobs(api.chat_chunk(cid, created, model, {}, api.finish_reason(finish, called)))
                last["timings"] = api.timings(job)
                tail.append(sse(last))
                if include_usage:
                    obj = "chat.completion.chunk" if parser is not None else "text_completion"
                    tail.append(sse({"id": cid, "object": obj, "created": created, "model": model, "choices": [],
                                     "usage": _usage(job, assembler)}))
                tail.append(sse("[DONE]"))
                yield b"".join(tail)
                return


async def _not_found(request: Request, exc: Exception) -> JSONResponse:
    status = getattr(exc, "status_code", 404)
    if status == 405:
        return error(405, f"method {request.method} is not allowed on {request.url.path}", code="method_not_allowed")
    if status == 404:
        return error(404, f"no route {request.method} {request.url.path}", code="not_found")
    detail = getattr(exc, "detail", "error")
    return error(status, str(detail))


def build_app(config: RunConfig, config_path: str | None = None, api_key: str | None = None,
              log_path: Path | None = None) -> Any:
    """The ASGI app (guarded, every request logged). `app.state.strata` holds the server state."""
    st = ServerState(config, config_path, api_key, log_path)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        st._boot = asyncio.create_task(st.boot())
        try:
            yield
        finally:
            st._boot.cancel()
            await st.supervisor.shutdown()

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/status", status, methods=["GET"]),
        Route("/metrics", metrics_json, methods=["GET"]),
        Route("/metrics/prometheus", metrics_prometheus, methods=["GET"]),
        *chat_page.routes(),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _not_found})
    app.state.strata = st
    guarded = Guard(app, api_key, config.host, config.allowed_hosts, config.max_body_bytes, chat_page.PAGE_PATHS)
    logged = AccessLog(guarded, say)
    logged.state = st  # type: ignore[attr-defined]
    return logged


__all__ = ["build_app", "ServerState"]
