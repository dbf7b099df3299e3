"""Shared helpers for the server tests: a live `python -m server` process over the real engine, run
on a HashLM model (engine/hashlm.py) through the test switches of engine/harness.py.

Imported by the other tests/test_server_*.py files (it holds no tests of its own).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from ports import free_port  # noqa: E402

from engine import harness  # noqa: E402
from engine.hashlm import Rule, write_hashlm  # noqa: E402
from server.tokens import load_vocabulary  # noqa: E402

TOK, TEMPLATE = load_vocabulary("", "bytes")


def chat_ids(messages: list[dict[str, Any]], **template_kwargs: Any) -> list[int]:
    """The prompt tokens the server sends for `messages` (byte vocabulary, Qwen3's template)."""
    return TOK.encode(TEMPLATE.render(messages, add_generation_prompt=True, **template_kwargs))


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


class LiveServer:
    """A server process over the real engine and a HashLM file that says what `rule` says.
    `switches` are the harness's (`{"tok_s": 0, "die_after": 20}`, engine/harness.py); every read
    the engine starts is logged (`admissions()`)."""

    def __init__(self, tmp: Path, config: dict[str, Any] | None = None, switches: dict[str, Any] | None = None,
                 rule: Rule | None = None, args: list[str] | None = None, env: dict[str, str] | None = None,
                 wait: bool = True):
        self.port = free_port()
        self.tmp = tmp
        self.rule = rule or Rule()
        self.admission_log = tmp / f"admissions-{self.port}.jsonl"
        cfg: dict[str, Any] = {
            "model": str(write_hashlm(tmp / f"hashlm-{self.port}.gguf", self.rule)), "model_name": "hashlm",
            "tokenizer": "bytes", "device": "cpu", "port": self.port, "log": str(tmp / f"engine-{self.port}.log"),
            "engine_command": harness.command(admission_log=self.admission_log, **(switches or {})),
        }
        cfg.update(config or {})
        self.config = cfg
        self.config_path = tmp / f"strata-{self.port}.json"
        self.config_path.write_text(json.dumps(cfg))
        self.out_path = tmp / f"server-{self.port}.out"
        penv = dict(os.environ)
        penv.pop("STRATA_API_KEY", None)
        penv.update(env or {})
        self.proc = subprocess.Popen([sys.executable, "-m", "server", "--config", str(self.config_path), *(args or [])],
                                     cwd=ROOT, stdout=open(self.out_path, "w"), stderr=subprocess.STDOUT, env=penv)
        self.base = f"http://127.0.0.1:{self.port}"
        self.key = cfg.get("api_key")
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        self.client = httpx.Client(base_url=self.base, timeout=60, headers=headers)
        if wait:
            self.wait_ready()

    def expected_chat(self, messages: list[dict[str, str]], max_tokens: int) -> tuple[str, str]:
        """(text, finish_reason) the model must give a chat request."""
        return self.rule.reply_text(chat_ids(messages), max_tokens)

    def expected_completion(self, prompt: str, max_tokens: int) -> str:
        return self.rule.reply_text(TOK.encode(prompt), max_tokens)[0]

    def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.output()}")
            try:
                if httpx.get(self.base + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"server not ready: {self.output()}")

    def output(self) -> str:
        return self.out_path.read_text() if self.out_path.exists() else ""

    def admissions(self) -> list[dict[str, Any]]:
        if not self.admission_log.exists():
            return []
        return [json.loads(line) for line in self.admission_log.read_text().splitlines() if line.strip()]

    def metrics(self) -> dict[str, Any]:
        return self.client.get("/metrics").json()

    def chat(self, messages: list[dict[str, str]], max_tokens: int = 64, **kw: Any) -> dict[str, Any]:
        r = self.client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": max_tokens, **kw})
        assert r.status_code == 200, r.text
        return r.json()

    def stop(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> LiveServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def sse_events(raw: str) -> list[str]:
    """The data payloads of an SSE body, checking the framing on the way."""
    assert raw.endswith("\n\n"), repr(raw[-40:])
    out = []
    for block in raw.split("\n\n")[:-1]:
        lines = [ln for ln in block.split("\n") if not ln.startswith(":")]
        if not lines:
            continue
        assert len(lines) == 1 and lines[0].startswith("data: "), repr(block)
        out.append(lines[0][6:])
    return out

