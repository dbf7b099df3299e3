"""Chat templates: the GGUF's own `tokenizer.chat_template` rendered as transformers renders it.

Same jinja2 setup as transformers' `apply_chat_template` (sandboxed, trim_blocks, lstrip_blocks,
loop controls, `raise_exception`, `strftime_now`, a non-escaping `tojson`), so a prompt rendered
here is byte-identical to the reference. Models without a template get a built-in one: Gemma's
turn format for the Gemma family (the demo model is a base model and ships none), ChatML otherwise;
`.source` says which was used.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Gemma 3's template: system text folded into the first user turn, "assistant" spelled "model".
GEMMA_TEMPLATE = """\
{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

# Qwen3's ChatML template (system, user, assistant with tool calls and <think> reasoning, tool
# results, `enable_thinking`), as its instruct models ship it, without the multi-step tool heuristics:
# the test model's template, the byte vocabulary's (server/tokens.py) and the fallback for a GGUF
# without a template (messages reach it with their content as text: server/chat_prompt.py).
QWEN3_CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.last and reasoning_content %}
            {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

_GEMMA_ARCHS = frozenset({"gemma", "gemma2", "gemma3", "gemma3n"})
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (used by some templates to mark assistant text)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters; chat templates expect plain JSON
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _plain(value: Any) -> Any:
    """Plain JSON-like copies of the caller's data (no objects with methods inside the sandbox)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool | int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if hasattr(value, "model_dump"):  # pydantic models, as a server may pass them
        return _plain(value.model_dump(exclude_none=True))
    return str(value)


class ChatTemplate:
    """A compiled chat template plus the special-token strings templates refer to."""

    def __init__(self, template: str, source: str, special_tokens: Mapping[str, str] | None = None):
        self.template = template
        self.source = source  # "gguf" | "builtin-gemma" | "builtin-chatml" | "builtin-qwen3" (byte vocabulary)
        self.special_tokens = dict(special_tokens or {})
        try:
            self._compiled = _environment().from_string(template)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"chat template ({source}) does not compile: line {exc.lineno}: {exc.message}") from exc

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> ChatTemplate:
        tokens = metadata.get("tokenizer.ggml.tokens") or []
        special = {}
        for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                          ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
            idx = metadata.get(f"tokenizer.ggml.{key}")
            if idx is not None and 0 <= int(idx) < len(tokens):
                special[name] = tokens[int(idx)]
        template = metadata.get("tokenizer.chat_template")
        if isinstance(template, str) and template.strip():
            return cls(template, "gguf", special)
        if str(metadata.get("general.architecture", "")) in _GEMMA_ARCHS:
            special.setdefault("bos_token", "<bos>")
            return cls(GEMMA_TEMPLATE, "builtin-gemma", special)
        return cls(QWEN3_CHAT_TEMPLATE, "builtin-chatml", special)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The prompt text for `messages` (OpenAI-style dicts); extra kwargs reach the template
        (`tools`, `enable_thinking`, ...). Raises ValueError when the template rejects the input."""
        chat = []
        for message in _plain(messages):
            if not isinstance(message, dict):
                raise ValueError(f"chat messages must be dicts, got {type(message).__name__}")
            reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
            chat.append(message)
        context = {"tools": None, "documents": None, **self.special_tokens, **_plain(kwargs)}
        try:
            return self._compiled.render(messages=chat, add_generation_prompt=add_generation_prompt, **context)
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template ({self.source}) failed: {exc}") from exc
        except (TypeError, KeyError, IndexError, AttributeError) as exc:
            raise ValueError(f"chat template ({self.source}) failed on these messages: {exc!r}") from exc
