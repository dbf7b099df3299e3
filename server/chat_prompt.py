"""From a chat request to the prompt text, through the model's chat template, and the parser of its reply.

The template gets the messages as transformers would pass them (tool calls with their arguments as
objects, tool results with their `tool_call_id`, reasoning as `reasoning_content`), the request's
`tools` (unless `tool_choice` is "none") and `chat_template_kwargs` (e.g. `enable_thinking`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.chat_template import ChatTemplate
from server.openai_api import ApiError, ChatRequest, Message
from server.reply_parser import THINK_CLOSE, THINK_OPEN, ReplyParser
from server.tool_calls import SUPPORTED, ToolSyntax, syntax_of


@dataclass(frozen=True)
class ChatPrompt:
    text: str
    syntax: ToolSyntax | None  # tools were offered: the reply's calls are read in this syntax
    reasoning: bool  # the template knows <think> tags
    thinking: bool  # the prompt ends inside an open <think> block
    max_calls: int | None

    def parser(self) -> ReplyParser:
        return ReplyParser(self.syntax, self.reasoning, self.thinking, self.max_calls)


def _arguments(text: str) -> Any:
    """Templates expect a call's arguments as an object (transformers' convention); text that is
    not a JSON object is passed as it came."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return value if isinstance(value, dict) else text


def template_message(m: Message) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                             for c in m.tool_calls]
    for key in ("name", "tool_call_id", "reasoning_content"):
        if getattr(m, key) is not None:
            out[key] = getattr(m, key)
    return out


def render_chat(body: ChatRequest, template: ChatTemplate) -> ChatPrompt:
    """The prompt for a chat request; ApiError 400 when it cannot be rendered as asked."""
    messages = [template_message(m) for m in body.messages]
    if not any(m["content"] or m.get("tool_calls") for m in messages):
        raise ApiError(400, "the messages are all empty", param="messages", code="invalid_value")
    kwargs = dict(body.chat_template_kwargs or {})
    tools = body.offered_tools()
    syntax = None
    if tools:
        syntax = syntax_of(template.template)
        if syntax is None:
            raise ApiError(400, f"this model's chat template shows no tool-call syntax this server reads "
                           f"({SUPPORTED}), so it cannot be offered tools", param="tools")
        kwargs["tools"] = tools
    try:
        text = template.render(messages, add_generation_prompt=True, **kwargs)
    except ValueError as exc:
        raise ApiError(400, f"the chat template cannot render these messages: {exc}", param="messages") from None
    reasoning = THINK_OPEN in template.template or THINK_CLOSE in template.template
    thinking = reasoning and text.rstrip().endswith(THINK_OPEN)
    return ChatPrompt(text, syntax, reasoning, thinking, None if body.parallel_tool_calls else 1)
