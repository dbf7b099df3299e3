"""engine.chat_template against transformers' apply_chat_template, and the built-in templates."""

from __future__ import annotations

import pytest
from reference import reference_tokenizer

from engine.chat_template import ChatTemplate
from engine.gguf_file import GGUFFile

TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Weather for a city",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}}}}}]
CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Weather in Paris?"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning_content": "easy"}],
    [{"role": "user", "content": "Weather?"},
     {"role": "assistant", "content": "", "tool_calls": [
         {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "content": "sunny, 21°C"}],
    [{"role": "user", "content": "unicode: café 😊 \"quotes\" <tags> & more"}],
]


@pytest.fixture(scope="module")
def tiny_template(tiny_model) -> ChatTemplate:
    return ChatTemplate.from_metadata(GGUFFile(tiny_model).metadata)


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"tools": TOOLS}])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tiny_matches_transformers(tiny_model, tiny_template, kwargs, add_generation_prompt):
    ref = reference_tokenizer(tiny_model)
    assert tiny_template.source == "gguf"
    for messages in CONVERSATIONS:
        ours = tiny_template.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        theirs = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **kwargs)
        assert ours == theirs


def test_gemma_builtin_format():
    tpl = ChatTemplate.from_metadata({"general.architecture": "gemma3", "tokenizer.ggml.tokens": ["<pad>", "<eos>", "<bos>"],
                                      "tokenizer.ggml.bos_token_id": 2})
    assert tpl.source == "builtin-gemma"
    assert tpl.render([{"role": "user", "content": "Hi"}]) == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    text = tpl.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                       {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}],
                      add_generation_prompt=False)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
                    "<start_of_turn>user\nBye<end_of_turn>\n")
    with pytest.raises(ValueError, match="alternate"):
        tpl.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_demo_model_gets_gemma_template(demo_model):
    tpl = ChatTemplate.from_metadata(GGUFFile(demo_model).metadata)
    assert tpl.source == "builtin-gemma"
    assert tpl.render([{"role": "user", "content": "Hi"}]).startswith("<bos><start_of_turn>user\nHi")


def test_chatml_fallback():
    tpl = ChatTemplate.from_metadata({"general.architecture": "qwen3moe"})
    assert tpl.source == "builtin-chatml"
    text = tpl.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_template_helpers():
    tpl = ChatTemplate('{{ messages[0].content | tojson }} {{ strftime_now("%Y") | length }}'
                       '{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}{{ m.content }}{% endfor %}',
                       "gguf")
    text = tpl.render([{"role": "user", "content": "é<b>"}, {"role": "user", "content": "!"}])
    assert text == '"é<b>" 4!'


def test_bad_templates_raise_value_error():
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate.from_metadata({"tokenizer.chat_template": "{% for m in messages %}{{ m.content }"})
    failing = ChatTemplate("{{ raise_exception('no system messages') }}", "gguf")
    with pytest.raises(ValueError, match="no system messages"):
        failing.render([{"role": "system", "content": "x"}])
    sandboxed = ChatTemplate("{{ messages.__class__.__mro__ }}", "gguf")
    with pytest.raises(ValueError):
        sandboxed.render([{"role": "user", "content": "x"}])
