"""Tool calls in the model's text: the Hermes / Qwen form ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

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
