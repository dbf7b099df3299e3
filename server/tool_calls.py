"""Tool calls as models write them: the syntaxes common chat templates teach, and their parsers.

A template shows the model how to call a tool; the same template tells us how to read the calls
back. `syntax_of(template_text)` picks one of:

- `HERMES` (Qwen, Hermes and most ChatML fine-tunes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  one per call, content before or between them allowed;
- `MISTRAL`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` or, from tokenizer v11 on,
  `[TOOL_CALLS]name[ARGS]{...}` (optionally `name[CALL_ID]id[ARGS]{...}`), to the end of the reply;
- `LLAMA3`: a reply that is a JSON object `{"name": ..., "parameters": {...}}` (several joined by
  `;`), optionally after `<|python_tag|>`.
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    """Nine letters and digits: the shape Mistral's templates insist on, and fine for every other."""
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=new_call_id)
    index: int = 0  # its place among the reply's calls

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolSyntax:
    name: str
    start: str  # the text that opens a call
    end: str | None  # the text that closes one call; None: the calls run to the end of the reply
    parse: Callable[[str], list[ToolCall] | None]  # the text between start and end; None: not calls
    leading_json: bool = False  # content that starts with "{" opens a call too


def _call_of(item: Any) -> ToolCall | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
        return None
    args = item.get("arguments", item.get("parameters", {}))
    if isinstance(args, str):
        args = _json_object(args)
    if not isinstance(args, dict):
        return None
    call_id = item.get("id")
    extra = {"id": call_id} if isinstance(call_id, str) and call_id else {}
    return ToolCall(item["name"], json.dumps(args, ensure_ascii=False), **extra)


def _json_object(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def parse_json_calls(body: str) -> list[ToolCall] | None:
    """One or more JSON calls (objects or lists of objects), separated by whitespace or ';'."""
    decoder = json.JSONDecoder()
    text, i, calls = body.strip(), 0, []
    while i < len(text):
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        for item in value if isinstance(value, list) else [value]:
            call = _call_of(item)
            if call is None:
                return None
            calls.append(call)
        while i < len(text) and (text[i].isspace() or text[i] == ";"):
            i += 1
    return calls or None


def parse_mistral_calls(body: str) -> list[ToolCall] | None:
    """`[{...}, ...]` (before v11) or `name[ARGS]{...}` / `name[CALL_ID]id[ARGS]{...}`, the calls
    after the first joined by `[TOOL_CALLS]`."""
    text = body.strip()
    if text.startswith("["):
        return parse_json_calls(text)
    calls = []
    for part in text.split(MISTRAL.start):
        head, sep, args = part.partition("[ARGS]")
        name, _, call_id = head.partition("[CALL_ID]")
        arguments = _json_object(args)
        if not sep or not name.strip() or arguments is None:
            return None
        extra = {"id": call_id.strip()} if call_id.strip() else {}
        calls.append(ToolCall(name.strip(), json.dumps(arguments, ensure_ascii=False), **extra))
    return calls


HERMES = ToolSyntax("hermes", "<tool_call>", "</tool_call>", parse_json_calls)
MISTRAL = ToolSyntax("mistral", "[TOOL_CALLS]", None, parse_mistral_calls)
LLAMA3 = ToolSyntax("llama3", "<|python_tag|>", None, parse_json_calls, leading_json=True)
SUPPORTED = "Hermes/Qwen <tool_call>, Mistral [TOOL_CALLS], Llama 3 JSON"


def syntax_of(template: str) -> ToolSyntax | None:
    """The tool-call syntax a chat template teaches; None when it takes no tools we can read back."""
    if "tools" not in template:
        return None
    for syntax in (HERMES, MISTRAL, LLAMA3):
        if syntax.start in template:
            return syntax
    if "<|start_header_id|>" in template and '"parameters"' in template:  # Llama 3.2/3.3: JSON only
        return LLAMA3
    return None
