"""Tool calls in the model's text: the Hermes / Qwen form ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
and (for the agent gateway, ``split_tool_calls(text, "llama3")``) Llama 3.1's JSON form: the whole turn is
``{"name": ..., "parameters": {...}}`` (after an optional ``<|python_tag|>``), several joined by ``;``.

Parsing reads the decoded text of the ids the model sampled; it never changes those ids. A call
that is not valid JSON, or lacks a name, is still a call: the model meant to use a tool, so it
gets an observation saying what was wrong (it learns the format) rather than ending the episode."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


@dataclass
class ToolCall:
    name: str  # "" when the call did not say
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # why the call could not be read; the observation says so

    def to_message(self) -> dict[str, Any]:
        """The OpenAI-style ``tool_calls`` entry chat templates render."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>...</tool_call>`` block of ``text``, in order."""
    return [_parse_one(body.strip()) for body in _CALL.findall(text)]


def _parse_one(body: str) -> ToolCall:
    try:
        data = json.loads(body)
    except json.JSONDecodeError as err:
        return ToolCall("", error=f"the tool call is not valid JSON ({err.msg} at char {err.pos}); write "
                                  '<tool_call>{"name": "...", "arguments": {...}}</tool_call>')
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return ToolCall("", error='the tool call has no "name"; write {"name": "...", "arguments": {...}}')
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):  # some models put the arguments in as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(data["name"], error=f'"arguments" must be a JSON object, got {type(arguments).__name__}')
    return ToolCall(data["name"], arguments)


TOOL_PARSERS = ("hermes", "llama3")
LLAMA_PYTHON_TAG = "<|python_tag|>"


def split_tool_calls(text: str, parser: str = "hermes") -> tuple[str, list[ToolCall]]:
    """``text`` (an assistant turn, its end-of-turn token removed) as the content outside the calls and the
    calls, by the model family's format (`TOOL_PARSERS`). No call: ``(text, [])``."""
    if parser == "hermes":
        calls = parse_tool_calls(text)
        return (_CALL.sub("", text).strip() if calls else text), calls
    if parser == "llama3":
        return _split_llama3(text)
    raise ValueError(f"tool parser {parser!r}: use one of {', '.join(TOOL_PARSERS)}")


def _split_llama3(text: str) -> tuple[str, list[ToolCall]]:
    body = text.strip()
    tagged = body.startswith(LLAMA_PYTHON_TAG)
    body = body.removeprefix(LLAMA_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text, []
    decoder, calls, position = json.JSONDecoder(), [], 0
    while position < len(body):
        try:
            data, end = decoder.raw_decode(body, position)
        except json.JSONDecodeError as err:
            if not calls and not tagged:
                return text, []  # a turn that merely starts with a brace: content, not a call
            return "", calls + [ToolCall("", error=f"the tool call is not valid JSON ({err.msg} at char {err.pos})")]
        if not isinstance(data, dict) or "name" not in data:
            return (text, []) if not calls and not tagged else ("", calls + [_parse_one(json.dumps(data))])
        calls.append(_parse_one(json.dumps(data)))
        position = end
        while position < len(body) and body[position] in " \n\t;":
            position += 1
    return "", calls
