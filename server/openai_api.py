"""OpenAI request bodies (pydantic), their checks, and the response/chunk/error shapes."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from engine.protocol import CONTEXT_SLACK, TOP_LOGPROBS_MAX, Logprob, Sampling
from server.config import SamplingFields
from server.reply_parser import Piece, Text
from server.tool_calls import ToolCall

MAX_STOP_STRINGS = 16


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
             404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
             500: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": ApiError.TYPES.get(status, "server_error"), "param": param,
                      "code": code}}


class _Body(SamplingFields):
    # strict: "5" is not an integer, "true" is not a boolean. Unknown fields are accepted and
    # ignored; the known ones this server cannot honour are refused (`_refuse`).
    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)
    user: str | None = None
    response_format: dict[str, Any] | None = None
    logit_bias: dict[str, Any] | None = None
    grammar: str | None = None  # llama.cpp's
    json_schema: dict[str, Any] | None = None  # llama.cpp's

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in items):
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("logit_bias", "grammar", "json_schema")
    @classmethod
    def _refuse(cls, v: Any, info: ValidationInfo) -> Any:
        if v:
            raise ValueError(f"{info.field_name} is not supported by this server")
        return v

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        kind = (v or {}).get("type", "text")
        if kind != "text":
            raise ValueError(f"response_format {kind!r} is not supported yet (it needs constrained decoding); "
                             "ask for JSON in the prompt, or leave response_format out")
        return v

    def logprobs_asked(self) -> int:
        """`Sampling.logprobs`: -1 = none, n >= 0 = each token's log-probability and n alternatives."""
        return -1

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    name: str = Field(min_length=1)
    arguments: str


class ToolCallIn(BaseModel):
    """A call in an assistant message of the history."""

    model_config = ConfigDict(strict=True, extra="allow")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    reasoning_content: str | None = None  # assistant

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v: Any) -> Any:
        if v is None or isinstance(v, str):
            return v
        if not isinstance(v, list):
            raise ValueError("content must be a string or a list of text parts")
        for part in v:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"content parts of type {kind!r} are not supported (only 'text')")
        return v

    @model_validator(mode="after")
    def _role_fields(self) -> Message:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class FunctionDef(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["function"]
    function: FunctionDef


TEMPLATE_OWN = ("messages", "add_generation_prompt", "tools")  # set by the request itself


class ChatRequest(_Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto"] | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS_MAX)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    def logprobs_asked(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else -1

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, v: Any) -> Any:
        if v == "required" or isinstance(v, dict):
            raise ValueError("only 'auto' and 'none' are supported: forcing a call needs constrained decoding")
        return v

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        own = [k for k in TEMPLATE_OWN if k in (v or {})]
        if own:
            raise ValueError(f"{own[0]!r} comes from the request itself, not from chat_template_kwargs")
        return v

    def offered_tools(self) -> list[dict[str, Any]]:
        """The tools the template is given (none with tool_choice 'none')."""
        if not self.tools or self.tool_choice == "none":
            return []
        return [t.model_dump(exclude_none=True) for t in self.tools]


class CompletionRequest(_Body):
    prompt: str | list[int] | list[str]
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None  # the legacy completions' number of alternatives

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v: int | None) -> int | None:
        if v:
            raise ValueError("logprobs is not supported on /v1/completions; /v1/chat/completions has them")
        return v

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: str | list[int] | list[str]) -> str | list[int] | list[str]:
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            if isinstance(v[0], str) and len(v) != 1:
                raise ValueError("only one prompt per request (a list of one string, or a list of token ids)")
            if isinstance(v[0], int) and any(i < 0 for i in v):  # type: ignore[operator]
                raise ValueError("token ids must be >= 0")
        elif not v:
            raise ValueError("prompt must not be empty")
        return v

    @field_validator("echo")
    @classmethod
    def _echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported")
        return v


ChatRequest.model_rebuild()
CompletionRequest.model_rebuild()


def parse_body(raw: bytes, model: type[_Body]) -> _Body:
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    if model is ChatRequest and "prompt" in data and "messages" not in data:
        raise ApiError(400, "'prompt' belongs to /v1/completions; chat requests take 'messages'", param="prompt")
    if model is CompletionRequest and "messages" in data and "prompt" not in data:
        raise ApiError(400, "'messages' belongs to /v1/chat/completions; completions take 'prompt'", param="messages")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        e = err.errors()[0]
        loc = ".".join(str(p) for p in e["loc"])
        got = e.get("input")
        shown = "" if isinstance(got, (dict, list)) else f" (got {json.dumps(got)[:60]})"
        more = f" (and {len(err.errors()) - 1} more)" if len(err.errors()) > 1 else ""
        raise ApiError(400, f"invalid '{loc}': {e['msg']}{shown}{more}", param=loc or None,
                       code="invalid_value") from None


def sampling_of(body: _Body, defaults: Any) -> Sampling:
    """Request values, else the config's sampling defaults, else greedy."""

    def pick(name: str, fallback: Any) -> Any:
        v = getattr(body, name)
        if v is None:
            v = getattr(defaults, name, None)
        return fallback if v is None else v

    return Sampling(temperature=float(pick("temperature", 0.0)), top_p=float(pick("top_p", 1.0)),
                    top_k=int(pick("top_k", 0)), min_p=float(pick("min_p", 0.0)), seed=int(pick("seed", 0)),
                    repeat_penalty=float(pick("repeat_penalty", 1.0)),
                    presence_penalty=float(pick("presence_penalty", 0.0)),
                    frequency_penalty=float(pick("frequency_penalty", 0.0)),
                    repeat_last_n=int(pick("repeat_last_n", 64)), logprobs=body.logprobs_asked())


def budget(prompt_tokens: int, asked: int | None, context: int, default_max: int | None) -> int:
    """max_new for a request; 400 when prompt + max_tokens + slack does not fit (never truncated)."""
    room = context - prompt_tokens - CONTEXT_SLACK
    if asked is None:
        if room < 1:
            raise ApiError(400, f"the prompt has {prompt_tokens} tokens, which leaves no room in the model's context of "
                           f"{context} tokens", param="messages", code="context_length_exceeded")
        return min(room, default_max) if default_max else room
    if asked > room:
        raise ApiError(400, f"this model's context is {context} tokens; the prompt has {prompt_tokens} tokens and "
                       f"max_tokens is {asked} (prompt + max_tokens + {CONTEXT_SLACK} must fit): shorten the prompt "
                       f"or lower max_tokens", param="max_tokens", code="context_length_exceeded")
    return asked


# ---------------------------------------------------------------------------------------------
# responses


def finish_reason(finish: str, called: bool = False) -> str:
    """OpenAI's finish_reason for the engine's `finish`; `called`: the reply made tool calls."""
    if finish == "length":
        return "length"
    return "tool_calls" if called else "stop"


def chat_message(pieces: list[Piece]) -> dict[str, Any]:
    """The assistant message of a whole reply: content (null when the reply only calls tools),
    reasoning_content and tool_calls when there are any."""
    def text(kind: str) -> str:
        return "".join(p.text for p in pieces if isinstance(p, Text) and p.kind == kind)

    content, reasoning = text("content"), text("reasoning")
    calls = [p.openai() for p in pieces if isinstance(p, ToolCall)]
    message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message


def chat_delta(piece: Piece) -> dict[str, Any]:
    if isinstance(piece, ToolCall):
        return {"tool_calls": [{"index": piece.index, **piece.openai()}]}
    return {"content" if piece.kind == "content" else "reasoning_content": piece.text}


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def timings(job: Any) -> dict[str, Any]:
    prompt_n = max(0, job.prompt_total - job.reused) if job.prompt_total else max(0, len(job.prompt) - job.reused)
    predicted_n = len(job.generated)
    pm, dm = job.prompt_ms, job.decode_ms
    return {"cache_n": job.reused, "prompt_n": prompt_n, "prompt_ms": round(pm, 3),
            "prompt_per_token_ms": round(pm / prompt_n, 3) if prompt_n else 0.0,
            "prompt_per_second": round(prompt_n / (pm / 1000), 2) if pm > 0 else 0.0,
            "predicted_n": predicted_n, "predicted_ms": round(dm, 3),
            "predicted_per_token_ms": round(dm / predicted_n, 3) if predicted_n else 0.0,
            "predicted_per_second": round(predicted_n / (dm / 1000), 2) if dm > 0 else 0.0}


def logprobs_content(tokens: Sequence[tuple[int, Logprob]], spell: Callable[[int], bytes]) -> dict[str, Any]:
    """A choice's `logprobs` (`{"content": [...], "refusal": None}`) for the reply's tokens; `spell`: a token's bytes."""

    def one(token: int, logprob: float) -> dict[str, Any]:
        raw = spell(token)
        return {"token": raw.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(raw)}

    return {"content": [{**one(token, lp.value), "top_logprobs": [one(i, v) for i, v in lp.top]}
                        for token, lp in tokens], "refusal": None}


def chat_chunk(cid: str, created: int, model: str, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def completion_chunk(cid: str, created: int, model: str, text: str, finish: str | None = None) -> dict[str, Any]:
    return {"id": cid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}


def chat_response(cid: str, model: str, message: dict[str, Any], finish: str, use: dict, tim: dict,
                  logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}],
            "usage": use, "timings": tim}


def completion_response(cid: str, model: str, text: str, finish: str, use: dict, tim: dict) -> dict[str, Any]:
    return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
            "usage": use, "timings": tim}
