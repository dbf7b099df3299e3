"""The server with the real engine (`python -m engine --serve`) on the tiny test model, end to end."""

from __future__ import annotations

import concurrent.futures as cf
import json
import sys
from pathlib import Path

import httpx
import pytest
from test_server_harness import ROOT, LiveServer, sse_events

from server.tokens import encode_prompt, load_vocabulary

ENGINE_SERVE = ROOT / "engine" / "loop.py"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real(request, tmp_path_factory):
    if not ENGINE_SERVE.exists():
        pytest.skip("the real engine (engine/loop.py) is not in this tree yet")
    try:
        model = request.getfixturevalue("tiny_model")
    except pytest.FixtureLookupError:
        pytest.skip("no tiny_model fixture (tests/conftest.py) to run the real engine on")
    for mod in ("engine.tokenizer", "engine.chat_template"):
        pytest.importorskip(mod, reason=f"{mod} is not in this tree yet")
    yield from _served(tmp_path_factory.mktemp("e2e"), model, parallel=2, exact=True,
                       engine_command=[sys.executable, "-m", "engine"])


def _served(tmp: Path, model: Path, switches: dict | None = None, **config):
    """A live server over `model` (the GGUF's own tokenizer, CPU), stopped after the module's tests."""
    cfg = {"model": str(Path(model)), "model_name": "tiny", "tokenizer": "gguf", "context": 512, "device": "cpu",
           "prefill": 64, **config}
    s = LiveServer(tmp, config=cfg, switches=switches, wait=False)
    try:
        s.wait_ready(timeout=120)
    except Exception:
        s.stop()
        raise
    yield s
    s.stop()


def ask(s: LiveServer, text: str, n: int = 8, **kw) -> dict:
    r = httpx.post(s.base + "/v1/chat/completions", timeout=120,
                   json={"messages": [{"role": "user", "content": text}], "max_tokens": n, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def test_real_engine_chat_stream_and_usage(real):
    st = real.client.get("/v1/status").json()
    assert st["loaded"] and st["concurrency"]["requested"] == 2
    r = ask(real, "Hello there")
    assert r["usage"]["completion_tokens"] >= 1 and r["usage"]["prompt_tokens"] > 3
    assert r["choices"][0]["finish_reason"] in ("stop", "length")
    body = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 8, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", real.base + "/v1/chat/completions", json=body, timeout=120) as resp:
        events = sse_events(resp.read().decode())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == r["choices"][0]["message"]["content"]  # greedy: the same answer streamed
    assert chunks[-1]["usage"]["completion_tokens"] == r["usage"]["completion_tokens"]
    again = ask(real, "Hello there")
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_real_engine_concurrent_equals_alone(real):
    prompts = ["one two three", "the quick brown fox"]
    alone = [ask(real, p, 10)["choices"][0]["message"]["content"] for p in prompts]
    with cf.ThreadPoolExecutor(2) as pool:
        together = list(pool.map(lambda p: ask(real, p, 10)["choices"][0]["message"]["content"], prompts))
    assert together == alone  # --exact: a conversation's greedy tokens are the same alone and in a batch
    m = real.metrics()
    assert m["live"]["parallel"] == m["engine"]["info"].get("batch_slots", 1) or m["live"]["parallel"] == 1
    assert m["totals"]["errors"] == 0


def test_real_engine_penalties_and_tools_reach_the_model(real):
    def complete(**kw) -> str:
        body = {"prompt": "the the the the cat sat on the the mat", "max_tokens": 24, **kw}
        r = httpx.post(real.base + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    assert complete(repeat_penalty=1.5, presence_penalty=0.6, repeat_last_n=8) != complete()
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    r = ask(real, "Weather in Paris?", 2, tools=tools)
    tokenizer, template = load_vocabulary(real.config["model"])
    rendered = template.render(messages, add_generation_prompt=True, tools=tools)
    assert "get_weather" in rendered and r["usage"]["prompt_tokens"] == len(encode_prompt(tokenizer, rendered))


@pytest.fixture(scope="module")
def ahead(tiny_model_q8, tmp_path_factory):
    """The server over the engine with decode windows queued ahead (`engine.harness --ahead 1`: on the CPU as
    on CUDA), four slots, default mode: the tiny Q8_0 model's rows get their solo tokens in any window."""
    yield from _served(tmp_path_factory.mktemp("ahead"), tiny_model_q8, {"ahead": 1}, parallel=4, exact=False)


def test_windows_queued_ahead_through_the_server(ahead):
    """Concurrent requests of different lengths (rows stopping while the next window is queued), a client
    that leaves mid-stream, then each prompt alone: every answer the same, and no error."""
    prompts = [("one two three", 12), ("the quick brown fox", 5), ("lorem ipsum dolor", 9), ("a b c d e f", 16)]
    with cf.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda p: ask(ahead, *p)["choices"][0]["message"]["content"], prompts))
        body = {"messages": [{"role": "user", "content": "left early"}], "max_tokens": 40, "stream": True}
        with httpx.stream("POST", ahead.base + "/v1/chat/completions", json=body, timeout=120) as resp:
            next(resp.iter_lines())  # one event, then the client goes away
    alone = [ask(ahead, *p)["choices"][0]["message"]["content"] for p in prompts]
    assert together == alone
    assert "decode windows queued ahead" in Path(ahead.config["log"]).read_text()
    m = ahead.metrics()
    assert m["engine"]["info"].get("batch_slots") == 4 and m["totals"]["errors"] == 0
