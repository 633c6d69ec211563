"""Tool calls by model family into OpenAI tool_calls (core/agent/tool_calls.split_tool_calls). Hermes/Qwen's form is
also covered through the gateway on the tiny Hermes tokenizer (test_gateway.py); Llama 3.1's JSON form on text
fixtures, since no Llama tokenizer or chat template is available offline."""

from __future__ import annotations

import pytest

from slime_rl.core.agent.tool_calls import split_tool_calls

# Llama 3.1's JSON tool calling, as its model card shows the assistant turn (after <|python_tag|>, or bare).
LLAMA_FIXTURES = [
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
     "", [("get_weather", {"city": "Paris"})]),
    ('{"name": "calc", "parameters": {"expression": "6*7"}}', "", [("calc", {"expression": "6*7"})]),
    ('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}', "", [("a", {}), ("b", {"x": 1})]),
    ('{"name": "calc", "arguments": "{\\"expression\\": \\"1+1\\"}"}', "", [("calc", {"expression": "1+1"})]),
    ("The weather in Paris is sunny.", "The weather in Paris is sunny.", []),
    ('{"city": "Paris"} is what I know.', '{"city": "Paris"} is what I know.', []),
]


@pytest.mark.parametrize("text, content, calls", LLAMA_FIXTURES)
def test_llama3_json_calls(text, content, calls):
    got_content, got = split_tool_calls(text, "llama3")
    assert got_content == content
    assert [(c.name, c.arguments) for c in got] == calls and all(c.error is None for c in got)


def test_a_broken_tagged_llama_call_is_an_error_not_content():
    _, calls = split_tool_calls('<|python_tag|>{"name": "calc", "parameters": {', "llama3")
    assert len(calls) == 1 and calls[0].error is not None


def test_hermes_content_outside_the_calls():
    text = 'Adding.\n<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n<tool_call>{"name": "b"}</tool_call>'
    content, calls = split_tool_calls(text, "hermes")
    assert content == "Adding." and [(c.name, c.arguments) for c in calls] == [("add", {"a": 1}), ("b", {})]
    assert split_tool_calls("no calls here", "hermes") == ("no calls here", [])


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="tool parser 'mistral'"):
        split_tool_calls("x", "mistral")
