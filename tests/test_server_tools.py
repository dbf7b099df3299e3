"""Tool calls, reasoning and chat_template_kwargs through the server, with the official `openai` client.

The real engine runs a HashLM model whose reply is a fixed text (`Rule(text=...)`) in the byte
vocabulary, whose chat template is Qwen3's (tools, <think>): a reasoning block and a Hermes tool call.
"""

from __future__ import annotations

import json

import openai
import pytest
from test_server_harness import LiveServer, chat_ids, sse_events, user

from engine.chat_template import GEMMA_TEMPLATE, ChatTemplate
from engine.hashlm import Rule
from server.chat_prompt import render_chat
from server.openai_api import ApiError, ChatRequest

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
REPLY = "<think>\nThe user wants the weather.\n</think>\n\n" + CALL
ASK = user("What is the weather in Paris?")


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = LiveServer(tmp_path_factory.mktemp("tools"), switches={"tok_s": 2000}, rule=Rule(text=REPLY))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.base + "/v1", api_key="unused")


def test_tool_call_non_streamed(client):
    r = client.chat.completions.create(model="hashlm", messages=ASK, tools=TOOLS, max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == "The user wants the weather."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and len(call.id) == 9
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert r.usage.prompt_tokens == len(chat_ids(ASK, tools=TOOLS))  # the tools reached the template


def test_tool_call_streamed_as_openai_deltas(client, srv):
    stream = client.chat.completions.create(model="hashlm", messages=ASK, tools=TOOLS, max_tokens=200, stream=True)
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks]
    reasoning = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert reasoning == "The user wants the weather."
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"} and calls[0].id
    assert not any(d.content for d in deltas)
    assert [c.choices[0].finish_reason for c in chunks][-1] == "tool_calls"
    # the raw frames: the role first, then one kind of delta per chunk, the call in one, the finish last
    body = {"messages": ASK, "tools": TOOLS, "max_tokens": 200, "stream": True}
    with srv.client.stream("POST", "/v1/chat/completions", json=body) as r:
        frames = [json.loads(e) for e in sse_events(r.read().decode())[:-1]]
    kinds = [set(f["choices"][0]["delta"]) for f in frames]
    assert kinds[0] == {"role", "content"} and kinds[-1] == set()
    assert all(len(k) == 1 for k in kinds[1:-1]) and kinds.count({"tool_calls"}) == 1


def test_tool_result_is_rendered_back(client, srv):
    first = client.chat.completions.create(model="hashlm", messages=ASK, tools=TOOLS, max_tokens=200).choices[0].message
    history = [*ASK, first, {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "sunny, 21 C"}]
    r = client.chat.completions.create(model="hashlm", messages=history, tools=TOOLS, max_tokens=200)
    expected = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny, 21 C"}]
    prompt = bytes(i for i in chat_ids(expected, tools=TOOLS) if i < 256).decode()
    assert CALL in prompt and "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
    assert r.usage.prompt_tokens == len(chat_ids(expected, tools=TOOLS))


def test_tool_choice_none_offers_no_tools_and_parses_none(client):
    r = client.chat.completions.create(model="hashlm", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=200)
    message = r.choices[0].message
    assert message.content == CALL and not message.tool_calls and r.choices[0].finish_reason == "stop"
    assert message.model_extra["reasoning_content"] == "The user wants the weather."
    assert r.usage.prompt_tokens == len(chat_ids(ASK))


def test_chat_template_kwargs_reach_the_template(client):
    r = client.chat.completions.create(model="hashlm", messages=ASK, max_tokens=200,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.usage.prompt_tokens == len(chat_ids(ASK, enable_thinking=False)) > len(chat_ids(ASK))


def test_unsupported_tool_options_are_refused(client):
    for kw, words in [({"tool_choice": "required"}, "constrained decoding"),
                      ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "constrained"),
                      ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "name")]:
        with pytest.raises(openai.BadRequestError, match=words):
            client.chat.completions.create(model="hashlm", messages=ASK, max_tokens=5, **{"tools": TOOLS, **kw})


def request(**kw) -> ChatRequest:
    return ChatRequest.model_validate({"messages": ASK, **kw})


def test_a_template_without_tools_refuses_them():
    gemma = ChatTemplate(GEMMA_TEMPLATE, "builtin-gemma")
    with pytest.raises(ApiError, match="no tool-call syntax"):
        render_chat(request(tools=TOOLS), gemma)
    assert render_chat(request(tools=TOOLS, tool_choice="none"), gemma).syntax is None


def test_thinking_opened_by_the_prompt():
    opened = ChatTemplate("{{ messages[0].content }}<think>\n", "gguf")
    prompt = render_chat(request(), opened)
    assert prompt.reasoning and prompt.thinking
    parser = prompt.parser()
    assert [p.kind for p in parser.feed("hmm</think>ok") + parser.finish()] == ["reasoning", "content"]
    plain = render_chat(request(), ChatTemplate("{{ messages[0].content }}", "gguf"))
    assert not plain.reasoning and not plain.thinking
