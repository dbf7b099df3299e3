"""Bad input, auth, limits and engine failures: each with its status and a message that says what is wrong."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest
from test_server_harness import ROOT, LiveServer, user

from engine.hashlm import Rule
from server.config import ConfigError, validate_config

CHAT = "/v1/chat/completions"
OK_MSGS = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
CALLED = {"role": "assistant", "content": None,
          "tool_calls": [{"id": "abc123XYZ", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = LiveServer(tmp_path_factory.mktemp("err"), config={"context": 512, "max_body_bytes": 4096})
    yield s
    s.stop()


BAD_CHAT = [
    # (name, body, status, words in the message)
    ("malformed json", b'{"messages": [', 400, "not valid JSON"),
    ("not an object", b"[1, 2]", 400, "JSON object"),
    ("missing messages", {"max_tokens": 5}, 400, "messages"),
    ("empty messages", {"messages": []}, 400, "messages"),
    ("messages not a list", {"messages": "hello"}, 400, "messages"),
    ("message without role", {"messages": [{"content": "x"}]}, 400, "role"),
    ("unknown role", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("content wrong type", {"messages": [{"role": "user", "content": 5}]}, 400, "content"),
    ("image content part", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "not supported"),
    ("all content empty", {"messages": [{"role": "user", "content": ""}]}, 400, "empty"),
    ("negative max_tokens", {"messages": OK_MSGS, "max_tokens": -5}, 400, "max_tokens"),
    ("zero max_tokens", {"messages": OK_MSGS, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens as string", {"messages": OK_MSGS, "max_tokens": "10"}, 400, "max_tokens"),
    ("negative temperature", {"messages": OK_MSGS, "temperature": -1}, 400, "temperature"),
    ("top_p zero", {"messages": OK_MSGS, "top_p": 0}, 400, "top_p"),
    ("top_p above one", {"messages": OK_MSGS, "top_p": 1.5}, 400, "top_p"),
    ("negative top_k", {"messages": OK_MSGS, "top_k": -1}, 400, "top_k"),
    ("min_p above one", {"messages": OK_MSGS, "min_p": 2}, 400, "min_p"),
    ("negative seed", {"messages": OK_MSGS, "seed": -1}, 400, "seed"),
    ("stream not a bool", {"messages": OK_MSGS, "stream": "yes"}, 400, "stream"),
    ("empty stop string", {"messages": OK_MSGS, "stop": [""]}, 400, "stop"),
    ("too many stop strings", {"messages": OK_MSGS, "stop": [str(i) for i in range(20)]}, 400, "stop"),
    ("n above one", {"messages": OK_MSGS, "n": 2}, 400, "'n'"),
    ("prompt on the chat route", {"prompt": "hi"}, 400, "/v1/completions"),
    ("tool without a function", {"messages": OK_MSGS, "tools": [{"type": "function"}]}, 400, "tools.0.function"),
    ("tool of another type", {"messages": OK_MSGS, "tools": [{"type": "web_search"}]}, 400, "tools.0.type"),
    ("tool_choice required", {"messages": OK_MSGS, "tools": TOOLS, "tool_choice": "required"}, 400, "tool_choice"),
    ("tool_choice unknown", {"messages": OK_MSGS, "tools": TOOLS, "tool_choice": "maybe"}, 400, "tool_choice"),
    ("tool message without tool_call_id", {"messages": [*OK_MSGS, CALLED, {"role": "tool", "content": "x"}]},
     400, "tool_call_id"),
    ("tool_calls on a user message", {"messages": [{**CALLED, "role": "user"}]}, 400, "assistant"),
    ("tool call arguments not a string", {"messages": [*OK_MSGS, {**CALLED, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": {}}}]}]}, 400, "arguments"),
    ("chat_template_kwargs sets the messages", {"messages": OK_MSGS, "chat_template_kwargs": {"messages": []}},
     400, "comes from the request"),
    ("chat_template_kwargs not an object", {"messages": OK_MSGS, "chat_template_kwargs": "x"}, 400,
     "chat_template_kwargs"),
    ("logprobs not a boolean", {"messages": OK_MSGS, "logprobs": 2}, 400, "logprobs"),
    ("top_logprobs without logprobs", {"messages": OK_MSGS, "top_logprobs": 3}, 400, "needs logprobs"),
    ("top_logprobs above 20", {"messages": OK_MSGS, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("logit_bias", {"messages": OK_MSGS, "logit_bias": {"50": -100}}, 400, "logit_bias"),
    ("response_format json_object", {"messages": OK_MSGS, "response_format": {"type": "json_object"}}, 400,
     "response_format"),
    ("response_format json_schema", {"messages": OK_MSGS, "response_format": {"type": "json_schema",
                                     "json_schema": {"name": "x", "schema": {}}}}, 400, "constrained decoding"),
    ("presence_penalty above two", {"messages": OK_MSGS, "presence_penalty": 3}, 400, "presence_penalty"),
    ("frequency_penalty below minus two", {"messages": OK_MSGS, "frequency_penalty": -3}, 400, "frequency_penalty"),
    ("repeat_penalty zero", {"messages": OK_MSGS, "repeat_penalty": 0}, 400, "repeat_penalty"),
    ("repeat_last_n below -1", {"messages": OK_MSGS, "repeat_last_n": -2}, 400, "repeat_last_n"),
    ("unknown stream_options field", {"messages": OK_MSGS, "stream_options": {"x": 1}}, 400, "stream_options"),
    ("prompt + max_tokens beyond the context", {"messages": OK_MSGS, "max_tokens": 600}, 400, "context"),
    ("prompt alone beyond the context", {"messages": [{"role": "user", "content": "w" * 800}]}, 400, "context"),
]


@pytest.mark.parametrize("name,body,status,words", BAD_CHAT, ids=[b[0] for b in BAD_CHAT])
def test_bad_chat_input(srv, name, body, status, words):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = srv.client.post(CHAT, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert words.lower() in err["message"].lower(), err


BAD_COMPLETIONS = [
    ("empty prompt", {"prompt": ""}, "prompt"),
    ("messages on completions", {"messages": OK_MSGS}, "/v1/chat/completions"),
    ("two prompts", {"prompt": ["a", "b"]}, "one prompt"),
    ("negative token id", {"prompt": [1, -2]}, ">= 0"),
    ("echo", {"prompt": "x", "echo": True}, "echo"),
    ("logprobs", {"prompt": "x", "logprobs": 5}, "logprobs"),
    ("response_format", {"prompt": "x", "response_format": {"type": "json_object"}}, "response_format"),
]


@pytest.mark.parametrize("name,body,words", BAD_COMPLETIONS, ids=[b[0] for b in BAD_COMPLETIONS])
def test_bad_completion_input(srv, name, body, words):
    r = srv.client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert words.lower() in r.json()["error"]["message"].lower()


def test_body_too_large(srv):
    big = json.dumps({"messages": [{"role": "user", "content": "x" * 10000}]})
    r = srv.client.post(CHAT, content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "max_body_bytes" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: counted while read
        for _ in range(10):
            yield b"x" * 1000

    r = srv.client.post(CHAT, content=chunks())
    assert r.status_code == 413


def test_context_error_names_the_numbers(srv):
    r = srv.client.post(CHAT, json={"messages": OK_MSGS, "max_tokens": 600})
    msg = r.json()["error"]
    assert "512" in msg["message"] and "600" in msg["message"] and msg["code"] == "context_length_exceeded"
    assert srv.chat(OK_MSGS, max_tokens=5)["usage"]["completion_tokens"] >= 1  # still serving


@pytest.mark.parametrize("host,status", [
    ("localhost", 200), ("localhost:8080", 200), ("app.localhost", 200), ("127.0.0.1:1", 200), ("[::1]:80", 200),
    ("evil.example.com", 403), ("rebind.attacker.net:8080", 403), ("", 403)])
def test_host_header_check_without_key(srv, host, status):
    r = srv.client.get("/v1/models", headers={"host": host})
    assert r.status_code == status, r.text
    if status == 403:
        assert r.json()["error"]["code"] == "host_not_allowed"
    assert srv.client.get("/health", headers={"host": "evil.example.com"}).status_code == 200


def test_api_key(tmp_path):
    with LiveServer(tmp_path, config={"api_key": "s3cret", "allowed_hosts": ["box.lan"]}) as s:
        bare = httpx.Client(base_url=s.base)
        r = bare.get("/v1/models")
        assert r.status_code == 401 and "no API key" in r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "authentication_error"
        r = bare.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["message"] == "invalid API key"
        assert bare.get("/v1/models", headers={"x-api-key": "wrong"}).status_code == 401
        assert bare.get("/metrics", headers={"x-api-key": "s3cret"}).status_code == 200
        assert bare.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert bare.get("/health").status_code == 200  # public
        # with a key the key is the check: any Host is fine
        assert bare.get("/v1/models", headers={"x-api-key": "s3cret", "host": "box.example"}).status_code == 200
        r = bare.post(CHAT, json={"messages": OK_MSGS, "max_tokens": 3})
        assert r.status_code == 401
        assert s.metrics()["config"]["api_key_set"] is True and "api_key" not in s.metrics()["config"]
        bare.close()


def test_key_from_env_and_flag(tmp_path):
    with LiveServer(tmp_path, env={"STRATA_API_KEY": "envkey"}) as s:
        assert httpx.get(s.base + "/v1/models").status_code == 401
        assert httpx.get(s.base + "/v1/models", headers={"x-api-key": "envkey"}).status_code == 200
    with LiveServer(tmp_path, args=["--api-key", "flagkey"]) as s:
        assert httpx.get(s.base + "/v1/models", headers={"x-api-key": "flagkey"}).status_code == 200


def _run_server(tmp_path, cfg: dict, *args: str) -> subprocess.CompletedProcess:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(cfg))
    return subprocess.run([sys.executable, "-m", "server", "--config", str(path), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin:/bin"})


def test_refuses_beyond_loopback_without_key_and_bad_config(tmp_path):
    r = _run_server(tmp_path, {"model": "m.gguf", "host": "0.0.0.0"})
    assert r.returncode == 2 and "without an API key" in r.stderr
    r = _run_server(tmp_path, {"model": "m.gguf"}, "--host", "0.0.0.0")
    assert r.returncode == 2 and "without an API key" in r.stderr
    r = _run_server(tmp_path, {"model": "m.gguf", "api_key": "  "})
    assert r.returncode == 2 and "empty" in r.stderr
    r = _run_server(tmp_path, {"model": "m.gguf", "parallel": 99})
    assert r.returncode == 2 and "parallel" in r.stderr and "8" in r.stderr
    r = _run_server(tmp_path, {"model": "m.gguf", "tokenizer": "words"})
    assert r.returncode == 2 and "tokenizer" in r.stderr and "'gguf'" in r.stderr and "'bytes'" in r.stderr
    r = _run_server(tmp_path, {"model": "m.gguf", "bogus_key": 1})
    assert r.returncode == 2 and "bogus_key" in r.stderr
    (tmp_path / "broken.json").write_text("{nope")
    r = subprocess.run([sys.executable, "-m", "server", "--config", str(tmp_path / "broken.json")], cwd=ROOT,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "not valid JSON" in r.stderr


@pytest.mark.parametrize("data,key,allowed", [
    ({"parallel": 0}, "parallel", "greater than or equal to 1"),
    ({"batch_groups": "many"}, "batch_groups", "'auto' or an integer"),
    ({"parallel": 4, "batch_groups": 3}, "batch_groups", "must divide"),
    ({"queue_limit": 0}, "queue_limit", "greater than or equal to 1"),
    ({"keepalive_s": 0}, "keepalive_s", "greater than 0"),
    ({"device": "tpu"}, "device", "'auto', 'cpu' or 'cuda'"),
    ({"port": 70000}, "port", "less than or equal to 65535"),
])
def test_config_errors_name_key_and_allowed_values(data, key, allowed):
    with pytest.raises(ConfigError) as err:
        validate_config({"model": "m.gguf", **data}, "strata-x.json")
    assert key in str(err.value) and allowed in str(err.value) and "strata-x.json" in str(err.value)


def test_engine_death_error_carries_log_and_next_request_restarts(tmp_path):
    with LiveServer(tmp_path, switches={"die_after": 20}, rule=Rule(ends=False)) as s:
        r = s.client.post(CHAT, json={"messages": OK_MSGS, "max_tokens": 50})
        assert r.status_code == 503, r.text
        msg = r.json()["error"]["message"]
        assert "engine" in msg and "illegal memory access" in msg  # the last log lines
        assert s.client.get("/health").status_code == 503
        text, _ = s.expected_chat(OK_MSGS, 10)
        r = s.client.post(CHAT, json={"messages": OK_MSGS, "max_tokens": 10})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == text
        m = s.metrics()
        assert m["engine"]["restarts"] == 1 and m["totals"]["errors"] == 1
        assert m["requests"][1]["finish"] == "error"
        # streamed: the error comes in the stream, then [DONE]
        body = {"messages": OK_MSGS, "max_tokens": 50, "stream": True}
        with s.client.stream("POST", CHAT, json=body) as resp:
            raw = resp.read().decode()
        assert '"error"' in raw and raw.rstrip().endswith("data: [DONE]")
        assert "restarting the engine" in s.output()


def test_engine_silent_is_ended_by_the_watchdog(tmp_path):
    with LiveServer(tmp_path, config={"engine_silence_s": 1.0}, switches={"silent_after": 5},
                    rule=Rule(ends=False)) as s:
        t = time.monotonic()
        r = s.client.post(CHAT, json={"messages": OK_MSGS, "max_tokens": 40})
        assert r.status_code == 503 and "silent" in r.json()["error"]["message"]
        assert time.monotonic() - t < 10
        r = s.client.post(CHAT, json={"messages": OK_MSGS, "max_tokens": 3})
        assert r.status_code == 200


def test_loading_answers_503(tmp_path):
    s = LiveServer(tmp_path, switches={"hold_until": str(tmp_path / "release")}, wait=False)  # loads once released
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                h = httpx.get(s.base + "/health")
                break
            except httpx.HTTPError:
                time.sleep(0.05)
        assert h.status_code == 503 and h.json()["status"] == "loading"
        r = httpx.post(s.base + CHAT, json={"messages": OK_MSGS})
        assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
        assert r.headers.get("retry-after")
        assert httpx.get(s.base + "/metrics").json()["live"]["state"] == "loading"
        (tmp_path / "release").touch()
        s.wait_ready()
        assert s.chat(OK_MSGS, max_tokens=3)
        assert "engine ready" in s.output() and "ready: http://127.0.0.1" in s.output()
    finally:
        s.stop()


def test_queue_full_503(tmp_path):
    import concurrent.futures as cf

    with LiveServer(tmp_path, config={"queue_limit": 1}, switches={"tok_s": 50}, rule=Rule(ends=False)) as s:
        def one(i):
            return httpx.post(s.base + CHAT, json={"messages": user(f"q{i}"), "max_tokens": 15}, timeout=30)

        with cf.ThreadPoolExecutor(5) as pool:
            results = list(pool.map(one, range(5)))
        codes = sorted(r.status_code for r in results)
        assert 503 in codes and 200 in codes
        busy = next(r for r in results if r.status_code == 503)
        assert busy.json()["error"]["code"] == "queue_full" and "queue_limit" in busy.json()["error"]["message"]


def test_engine_death_with_batch_slots_fails_every_running_request(tmp_path):
    import concurrent.futures as cf

    with LiveServer(tmp_path, config={"parallel": 2}, switches={"tok_s": 200, "die_after": 60},
                    rule=Rule(ends=False)) as s:
        def one(i):
            return httpx.post(s.base + CHAT, json={"messages": user(f"d{i}"), "max_tokens": 100}, timeout=30)

        with cf.ThreadPoolExecutor(3) as pool:
            results = list(pool.map(one, range(3)))
        assert all(r.status_code == 503 for r in results), [r.text for r in results]  # each engine dies at 60
        assert all("illegal memory access" in r.json()["error"]["message"] for r in results if r.status_code == 503)
        text, _ = s.expected_chat(user("after"), 5)
        r = s.client.post(CHAT, json={"messages": user("after"), "max_tokens": 5})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == text
        assert s.client.get("/v1/status").json()["concurrency"]["serving"] == 2


def test_every_request_leaves_a_timed_line_in_the_server_log(tmp_path):
    """As llama-server: status, method, path, time and tokens per request; refused ones too; the
    dashboard's successful polls are left out."""
    import re
    import time

    with LiveServer(tmp_path, config={"api_key": "k"}) as s:
        bare = httpx.Client(base_url=s.base)
        assert bare.post(CHAT, json={"messages": OK_MSGS, "max_tokens": 3}).status_code == 401
        assert s.client.get("/nope").status_code == 404
        assert s.client.post(CHAT, json={"messages": OK_MSGS, "max_tokens": 3}).status_code == 200
        assert s.client.post(CHAT, json={"messages": []}).status_code == 400
        assert s.client.get("/metrics").status_code == 200
        bare.close()
        deadline = time.monotonic() + 5
        while s.output().count(" from 127.0.0.1 in ") < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        lines = [line for line in s.output().splitlines() if " from 127.0.0.1 in " in line]
    stamp = r"\d\d:\d\d:\d\d \[strata\] "
    assert re.fullmatch(stamp + r"401 POST /v1/chat/completions from 127\.0\.0\.1 in \d+ ms", lines[0]), lines
    assert re.fullmatch(stamp + r"404 GET /nope from .* in \d+ ms", lines[1]), lines
    assert re.fullmatch(stamp + r"200 POST /v1/chat/completions from .* in [\d.]+ m?s: prompt \d+ \(0 reused\), "
                        r"out 3 \([\d.]+ tok/s, length, solo\)", lines[2]), lines
    assert lines[3].endswith("400 POST /v1/chat/completions from 127.0.0.1 in " + lines[3].split(" in ")[1])
    assert len(lines) == 4  # GET /metrics 200: a poll, not logged
