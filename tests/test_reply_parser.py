"""server.reply_parser and server.tool_calls: a reply split into content, reasoning and tool calls,
the same whether it arrives whole or cut anywhere; the tool-call syntaxes found from templates."""

from __future__ import annotations

import json

import pytest

from engine.chat_template import GEMMA_TEMPLATE, QWEN3_CHAT_TEMPLATE
from server.reply_parser import Piece, ReplyParser, Text
from server.tool_calls import HERMES, LLAMA3, MISTRAL, ToolCall, syntax_of

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def content(text: str) -> Text:
    return Text("content", text)


def reasoning(text: str) -> Text:
    return Text("reasoning", text)


def call(name: str, arguments: dict, index: int = 0) -> tuple:
    return ("call", name, arguments, index)


# (name, reply, syntax, reasoning, thinking, max_calls, expected pieces with texts merged)
CASES = [
    ("plain text, nothing held", "  Hello <b>world</b> \n", None, False, False, None, [content("  Hello <b>world</b> \n")]),
    ("reasoning then content", "<think>\nI think.\n</think>\n\nAnswer.", None, True, False, None,
     [reasoning("I think."), content("Answer.")]),
    ("the prompt opened the think block", "I think.\n</think>\n\nAnswer.", None, True, True, None,
     [reasoning("I think."), content("Answer.")]),
    ("<think> later in the reply is content", "a <think> b", None, True, False, None, [content("a <think> b")]),
    ("a tag that only starts like <think>", "<thing> x", None, True, False, None, [content("<thing> x")]),
    ("reasoning cut by max_tokens", "<think>\nstill going ", None, True, False, None, [reasoning("still going")]),
    ("calls without tools offered are content", f"<tool_call>{WEATHER}</tool_call>", None, True, False, None,
     [content(f"<tool_call>{WEATHER}</tool_call>")]),
    ("hermes: content, then two calls", f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n"
     '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n', HERMES, True, False, None,
     [content("Let me check."), call("get_weather", {"city": "Paris"}), call("get_time", {}, 1)]),
    ("hermes: reasoning, then a call", f"<think>\nweather needed\n</think>\n\n<tool_call>\n{WEATHER}\n</tool_call>",
     HERMES, True, False, None, [reasoning("weather needed"), call("get_weather", {"city": "Paris"})]),
    ("hermes: arguments as a JSON string", '<tool_call>{"name": "f", "arguments": "{\\"a\\": [1, 2]}"}</tool_call>',
     HERMES, False, False, None, [call("f", {"a": [1, 2]})]),
    ("hermes: a call cut by max_tokens still parses", f"<tool_call>\n{WEATHER}", HERMES, False, False, None,
     [call("get_weather", {"city": "Paris"})]),
    ("hermes: not JSON stays content", "<tool_call>oops</tool_call> after", HERMES, False, False, None,
     [content("<tool_call>oops</tool_call> after")]),
    ("hermes: a look-alike stays content", "a <tool b <tool_cal", HERMES, False, False, None,
     [content("a <tool b <tool_cal")]),
    ("tools offered, no call: whitespace kept", "Hi there \n", HERMES, True, False, None, [content("Hi there \n")]),
    ("parallel_tool_calls false keeps the first", f"<tool_call>{WEATHER}</tool_call>\n<tool_call>{WEATHER}</tool_call>"
     " and more", HERMES, False, False, 1, [call("get_weather", {"city": "Paris"})]),
    ("mistral: JSON list with ids", '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}, "id": "abcDEF123"}, '
     '{"name": "g", "arguments": {}}]', MISTRAL, False, False, None, [call("f", {"a": 1}), call("g", {}, 1)]),
    ("mistral v11: name[ARGS]", 'Sure. [TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[CALL_ID]xyz987abc[ARGS]{}',
     MISTRAL, False, False, None, [content("Sure."), call("f", {"a": 1}), call("g", {}, 1)]),
    ("mistral: broken stays content", "[TOOL_CALLS]f{", MISTRAL, False, False, None, [content("[TOOL_CALLS]f{")]),
    ("llama3: a reply that is JSON calls", ' {"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}',
     LLAMA3, False, False, None, [call("f", {"a": 1}), call("g", {}, 1)]),
    ("llama3: after <|python_tag|>", '<|python_tag|>{"name": "f", "parameters": {}}', LLAMA3, False, False, None,
     [call("f", {})]),
    ("llama3: JSON that is no call is content", '{"answer": 42}', LLAMA3, False, False, None,
     [content('{"answer": 42}')]),
    ("llama3: JSON after text is content", 'It is {"name": "f", "parameters": {}}', LLAMA3, False, False, None,
     [content('It is {"name": "f", "parameters": {}}')]),
]


def normal(pieces: list[Piece]) -> list:
    """Texts of one kind merged; calls as (name, arguments, index)."""
    out: list = []
    for p in pieces:
        if isinstance(p, ToolCall):
            assert len(p.id) == 9 and p.id.isalnum()
            out.append(call(p.name, json.loads(p.arguments), p.index))
        elif out and isinstance(out[-1], Text) and out[-1].kind == p.kind:
            out[-1] = Text(p.kind, out[-1].text + p.text)
        else:
            out.append(p)
    return out


def run(reply: str, cuts: list[int], *args) -> list[Piece]:
    parser = ReplyParser(*args)
    pieces: list[Piece] = []
    for a, b in zip([0, *cuts], [*cuts, len(reply)], strict=True):
        pieces += parser.feed(reply[a:b])
    return pieces + parser.finish()


@pytest.mark.parametrize("name,reply,syntax,reasoning_,thinking,max_calls,expected", CASES, ids=[c[0] for c in CASES])
def test_split_is_the_same_whole_or_cut_anywhere(name, reply, syntax, reasoning_, thinking, max_calls, expected):
    args = (syntax, reasoning_, thinking, max_calls)
    assert normal(run(reply, [], *args)) == expected
    assert normal(run(reply, list(range(1, len(reply))), *args)) == expected  # one character at a time
    for cut in range(1, len(reply)):
        assert normal(run(reply, [cut], *args)) == expected, cut


def test_streamed_text_is_never_taken_back():
    parser = ReplyParser(HERMES, True, False)
    assert parser.feed("Let me check") == [content("Let me check")]
    assert parser.feed(".\n<tool") == [content(".")]  # the newline and "<tool" wait
    assert parser.feed("_call>") == []
    pieces = parser.feed(f"{WEATHER}</tool_call>")
    assert [type(p) for p in pieces] == [ToolCall] and pieces[0].index == 0


def test_mistral_ids_are_kept():
    pieces = run('[TOOL_CALLS]g[CALL_ID]xyz987abc[ARGS]{"q": "x"}', [], MISTRAL, False, False, None)
    assert [p.id for p in pieces] == ["xyz987abc"]
    assert pieces[0].openai() == {"id": "xyz987abc", "type": "function",
                                  "function": {"name": "g", "arguments": '{"q": "x"}'}}


LLAMA31 = ('{%- if tools %}<|start_header_id|>{{ tools | tojson }}{%- endif %}'
           '{%- if builtin_tools is defined %}<|python_tag|>{%- endif %}')
LLAMA32 = ('<|start_header_id|>system<|end_header_id|>{%- if tools %}Respond in the format {"name": function name, '
           '"parameters": dictionary of argument name and its value}.{%- endif %}')
MISTRAL_TEMPLATE = "{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}[TOOL_CALLS]"


@pytest.mark.parametrize("template,syntax", [
    (QWEN3_CHAT_TEMPLATE, HERMES), (LLAMA31, LLAMA3), (LLAMA32, LLAMA3), (MISTRAL_TEMPLATE, MISTRAL),
    (GEMMA_TEMPLATE, None), ("{% if tools %}<|tool_calls_begin|>{% endif %}", None)])
def test_syntax_of_template(template, syntax):
    assert syntax_of(template) is syntax
