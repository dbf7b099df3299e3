"""Talking to the server under test: one streamed chat request timed, a round of them at once, the
model's id and what the server says about itself."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx

from strata_desk.bench.prompts import build_prompt
from strata_desk.bench.results import RequestResult, RoundResult
from strata_desk.bench.spec import BenchError, BenchSpec


async def one_request(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int,
                       t0: float, thinking: bool = False) -> RequestResult:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "chat_template_kwargs": {"enable_thinking": thinking}}
    result = RequestResult()
    counted = 0
    usage_tokens = None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as reply:
            if reply.status_code != 200:
                text = (await reply.aread()).decode(errors="replace")[:200]
                result.error = f"HTTP {reply.status_code}: {text}"
                result.end_s = time.monotonic() - t0
                return result
            async for line in reply.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if delta.get("content") or delta.get("reasoning_content"):
                        counted += 1
                        if result.first_s is None:
                            result.first_s = time.monotonic() - t0
    except (httpx.HTTPError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.end_s = time.monotonic() - t0
    result.tokens = int(usage_tokens) if usage_tokens is not None else counted
    return result


async def run_round(client: httpx.AsyncClient, model: str, spec: BenchSpec, concurrency: int,
                     salt: str) -> RoundResult:
    prompts = [build_prompt(i, spec.prompt_words, salt) for i in range(concurrency)]
    t0 = time.monotonic()
    results = await asyncio.gather(*(one_request(client, model, p, spec.max_tokens, t0, spec.thinking)
                                     for p in prompts))
    return RoundResult(list(results))


async def get_json(client: httpx.AsyncClient, path: str) -> dict[str, Any]:
    try:
        reply = await client.get(path)
        return reply.json() if reply.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}


async def server_view(client: httpx.AsyncClient) -> dict[str, Any]:
    metrics = await get_json(client, "/metrics")
    status = await get_json(client, "/v1/status")
    return {"config": metrics.get("config"), "devices": metrics.get("devices"), "host": metrics.get("host"),
            "engine": metrics.get("engine"), "status": status}


async def model_id(client: httpx.AsyncClient) -> str:
    reply = await client.get("/v1/models")
    if reply.status_code == 401:
        raise BenchError("the server wants an API key (--key)")
    reply.raise_for_status()
    data = reply.json().get("data") or []
    if not data:
        raise BenchError("the server lists no model")
    return str(data[0]["id"])


def client_for(url: str, key: str | None, timeout: float) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.AsyncClient(base_url=url, headers=headers,
                             timeout=httpx.Timeout(timeout, connect=10.0),
                             limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))
