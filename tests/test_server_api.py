"""The OpenAI API against a live server and the real engine on a HashLM model (one request at a time)."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from test_server_harness import LiveServer, chat_ids, sse_events, user

from engine.hashlm import Rule
from server.metrics_schema import MetricsSnapshot, StatusView


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = LiveServer(tmp_path_factory.mktemp("api"))
    yield s
    s.stop()


def test_health_models_status(srv):
    h = srv.client.get("/health").json()
    assert h["status"] == "ok" and h["model"] == "hashlm" and h["max_context"] == 4096
    m = srv.client.get("/v1/models").json()
    assert m["object"] == "list" and m["data"][0]["id"] == "hashlm"
    st = StatusView.model_validate(srv.client.get("/v1/status").json())
    assert st.loaded and st.concurrency.serving == 1 and st.concurrency.requested == 1


def test_chat_non_stream_is_complete_and_correct(srv):
    msgs = user("What is the capital of France?")
    text, finish = srv.expected_chat(msgs, 200)
    r = srv.chat(msgs, max_tokens=200)
    assert r["object"] == "chat.completion"
    assert r["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert r["choices"][0]["finish_reason"] == finish
    assert r["usage"]["prompt_tokens"] == len(chat_ids(msgs))
    assert r["usage"]["total_tokens"] == r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"]
    assert "cached_tokens" in r["usage"]["prompt_tokens_details"]
    assert set(r["timings"]) >= {"prompt_n", "prompt_ms", "predicted_n", "predicted_per_second", "cache_n"}


def test_max_tokens_gives_length(srv):
    msgs = user("count")
    r = srv.chat(msgs, max_tokens=3)
    text, finish = srv.expected_chat(msgs, 3)
    assert r["choices"][0]["message"]["content"] == text
    assert r["usage"]["completion_tokens"] == 3
    assert r["choices"][0]["finish_reason"] == finish


def test_stream_raw_sse_framing_and_usage(srv):
    msgs = user("stream me")
    text, finish = srv.expected_chat(msgs, 100)
    body = {"messages": msgs, "max_tokens": 100, "stream": True, "stream_options": {"include_usage": True}}
    with srv.client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["cache-control"] == "no-cache"
        raw = r.read().decode()
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    got = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert got == text
    final = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(final) == 1 and final[0]["choices"][0]["finish_reason"] == finish and "timings" in final[0]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == len(chat_ids(msgs))


def test_stream_without_usage_has_no_usage_chunk(srv):
    body = {"messages": user("x"), "max_tokens": 5, "stream": True}
    with srv.client.stream("POST", "/v1/chat/completions", json=body) as r:
        events = sse_events(r.read().decode())
    assert all("usage" not in json.loads(e) for e in events[:-1])


def test_stop_string_non_stream_and_stream_do_not_leak(srv):
    msgs = user("a story with stops")
    text, _ = srv.expected_chat(msgs, 300)
    assert len(text) > 12, text
    stop = text[6:9]
    want = text[: text.find(stop)]
    r = srv.chat(msgs, max_tokens=300, stop=[stop, "\u2603never"])
    assert r["choices"][0]["message"]["content"] == want
    assert r["choices"][0]["finish_reason"] == "stop"
    body = {"messages": msgs, "max_tokens": 300, "stop": stop, "stream": True}
    with srv.client.stream("POST", "/v1/chat/completions", json=body) as resp:
        events = sse_events(resp.read().decode())
    pieces = [json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1]]
    assert "".join(pieces) == want
    assert all(stop[:k] not in p[-k:] or not p for p in pieces for k in range(len(stop), len(stop) + 1))
    # the next request is unaffected by the stopped one
    text2, _ = srv.expected_chat(user("after stop"), 40)
    assert srv.chat(user("after stop"), max_tokens=40)["choices"][0]["message"]["content"] == text2


def test_completions_text_and_ids(srv):
    prompt = "Once upon a time"
    r = srv.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 20}).json()
    want = srv.expected_completion(prompt, 20)
    assert r["object"] == "text_completion" and r["choices"][0]["text"] == want
    r2 = srv.client.post("/v1/completions", json={"prompt": list(prompt.encode()), "max_tokens": 20}).json()
    assert r2["choices"][0]["text"] == want
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the engine's prompt cache
    with srv.client.stream("POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 20, "stream": True}) as s:
        events = sse_events(s.read().decode())
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == want


def test_sampling_keys_reach_the_engine(srv):
    r = srv.chat(user("sampled"), max_tokens=5, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=7,
                 presence_penalty=0.5, frequency_penalty=-0.5, repeat_penalty=1.1, repeat_last_n=-1)
    assert r["usage"]["completion_tokens"] >= 1  # the engine took every key (a line it cannot parse is an ERR)


def test_openai_package_sync_async_stream(srv):
    client = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused")
    msgs = user("openai sync")
    text, _ = srv.expected_chat(msgs, 60)
    r = client.chat.completions.create(model="hashlm", messages=msgs, max_tokens=60)
    assert r.choices[0].message.content == text
    assert r.usage.prompt_tokens == len(chat_ids(msgs))
    stream = client.chat.completions.create(model="hashlm", messages=msgs, max_tokens=60, stream=True,
                                            stream_options={"include_usage": True})
    parts, usage = [], None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    assert "".join(parts) == text and usage is not None and usage.completion_tokens >= 1
    assert [m.id for m in client.models.list()] == ["hashlm"]

    async def run_async() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=srv.base + "/v1", api_key="unused")
        msgs2 = [user(f"async {i}") for i in range(3)]
        rs = await asyncio.gather(*(aclient.chat.completions.create(model="hashlm", messages=m, max_tokens=30)
                                    for m in msgs2))
        out = [x.choices[0].message.content for x in rs]
        s = await aclient.completions.create(model="hashlm", prompt="hi there", max_tokens=10, stream=True)
        out.append("".join([c.choices[0].text async for c in s]))
        await aclient.close()
        return out

    got = asyncio.run(run_async())
    for i in range(3):
        assert got[i] == srv.expected_chat(user(f"async {i}"), 30)[0]
    assert got[3] == srv.expected_completion("hi there", 10)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="hashlm", messages=[], max_tokens=5)
    assert "messages" in str(err.value)


def test_logprobs_with_the_openai_package_streamed_and_not(srv):
    client = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused")
    msgs = user("logprobs please")
    text, _ = srv.expected_chat(msgs, 40)
    r = client.chat.completions.create(model="hashlm", messages=msgs, max_tokens=40, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == text
    assert b"".join(bytes(t.bytes) for t in content) == text.encode()  # one entry per token of the reply
    assert len(content) == r.usage.completion_tokens - (r.choices[0].finish_reason == "stop")  # not the end token
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 2
        assert (t.top_logprobs[0].bytes, t.top_logprobs[0].logprob) == (t.bytes, t.logprob)  # greedy: the best
    stream = client.chat.completions.create(model="hashlm", messages=msgs, max_tokens=40, logprobs=True,
                                            top_logprobs=2, stream=True)
    streamed = [t for chunk in stream for choice in chunk.choices if choice.logprobs for t in choice.logprobs.content]
    assert [t.model_dump() for t in streamed] == [t.model_dump() for t in content]
    plain = client.chat.completions.create(model="hashlm", messages=msgs, max_tokens=40)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == text


def test_metrics_json_matches_schema_and_prometheus(srv):
    srv.chat(user("for metrics"), max_tokens=10)
    snap = MetricsSnapshot.model_validate(srv.metrics())
    assert snap.engine.state == "ready" and snap.engine.info["arch"] == "hashlm"
    assert snap.totals.requests >= 1 and snap.requests and snap.requests[0].output_tokens >= 1
    assert snap.config.model == srv.config["model"] and not snap.config.api_key_set
    assert snap.live.parallel == 1 and snap.live.slots == []
    assert snap.devices == [] or snap.devices[0].total_mib > 0
    assert snap.host.ram_total_mib > 0
    # on the CPU the engine serves every routed expert lookup there: none from VRAM
    assert snap.tier is not None and snap.tier.cpu_share == 1 or snap.stats is None
    raw = srv.client.get("/metrics").text
    assert "prompt" not in json.dumps(json.loads(raw)["live"]["slots"])
    prom = srv.client.get("/metrics/prometheus")
    assert prom.status_code == 200 and prom.headers["content-type"].startswith("text/plain")
    assert snap.totals.lookups > 0 and snap.totals.hits == 0
    for name in ("strata_requests_total", "strata_output_tokens_total", "strata_tokens_per_second",
                 "strata_expert_hits_total", "strata_expert_lookups_total",
                 "strata_host_memory_total_bytes"):
        assert name in prom.text
    all_rows = srv.client.get("/metrics", params={"requests": "all"}).json()["requests"]
    assert len(all_rows) >= len(snap.requests)


def test_unknown_route_and_method(srv):
    r = srv.client.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = srv.client.get("/v1/chat/completions")
    assert r.status_code == 405 and "not allowed" in r.json()["error"]["message"]


def test_keepalive_comments_during_a_slow_prompt(tmp_path):
    with LiveServer(tmp_path, config={"keepalive_s": 0.2, "prefill": 64},
                    switches={"prefill_tok_s": 200}) as s:
        body = {"messages": user("x" * 300), "max_tokens": 5, "stream": True}
        with httpx.stream("POST", s.base + "/v1/chat/completions", json=body, timeout=30) as r:
            raw = r.read().decode()
        assert ": keep-alive" in raw
        assert sse_events(raw)[-1] == "[DONE]"


def test_engine_stats_line_as_documented_becomes_tier_and_stats():
    from server.config import RunConfig
    from server.metrics import Metrics

    example = {"windows": 120, "rows": 3.0, "window_ms": 41.2, "tokens": 360, "slot_tokens": {"1": 120, "2": 120},
               "prefill_tokens": 2048, "prefill_ms": 812.0,
               "tier": {"mode": "resident", "vram": 0.75, "pcie": 0.05, "cpu": 0.2, "hits": 2880, "lookups": 3200,
                        "swaps": 4, "adapt_rounds": 2, "adapt_wait_ms": 0.3},
               "memory": [{"device": "cuda:0", "total_mib": 143771, "weights_mib": 30100, "experts_mib": 28000,
                           "slots_mib": 1200, "kv_mib": 400, "free_mib": 110000}]}
    m = Metrics(RunConfig(model="x.gguf"), None)
    m.on_stats(example)
    tier, stats = m._tier(), m._stats_view()
    assert tier.vram_share == 0.75 and tier.pcie_share == 0.05 and tier.cpu_share == 0.2
    assert tier.hit_rate == 0.9 and tier.swaps == 4 and tier.adapt_rounds == 2 and tier.adapt_wait_ms == 0.3
    assert tier.hits == 2880 and tier.lookups == 3200 and tier.offloaded == 0  # the totals, for windows
    assert stats.windows == 120 and stats.rows == 360 and stats.rows_per_window == 3.0
    assert stats.ms_per_window == 41.2 and stats.prefill_tokens == 2048 and stats.slot_tokens == {"1": 120, "2": 120}
    assert m.stats.memory[0].cuda_index == 0
    m.on_stats({**example, "tier": None})
    assert m._tier() is None  # a dense model
    m.on_stats({"windows": "garbage"})  # ignored, the last good one stays
    assert m._stats_view().windows == 120


def test_reply_text_and_utf8_split_across_tokens(tmp_path):
    text = "Grüße, 世界! ✓ done."
    with LiveServer(tmp_path, switches={"tok_s": 500}, rule=Rule(text=text)) as s:
        r = s.chat(user("say it"), max_tokens=200)
        assert r["choices"][0]["message"]["content"] == text and r["choices"][0]["finish_reason"] == "stop"
        assert r["usage"]["completion_tokens"] == len(text.encode()) + 1  # every byte, then the end token
        body = {"messages": user("say it again"), "max_tokens": 200, "stream": True, "stop": ["done"]}
        with s.client.stream("POST", "/v1/chat/completions", json=body) as resp:
            events = sse_events(resp.read().decode())
        pieces = [json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1]]
        assert "".join(pieces) == text[: text.find("done")]
        assert all("\ufffd" not in p for p in pieces)  # no multi-byte character cut in two
        r = s.chat(user("short"), max_tokens=5)
        assert r["choices"][0]["message"]["content"] == text.encode()[:5].decode("utf-8", "replace")
        assert r["choices"][0]["finish_reason"] == "length"
