"""OpenAI request bodies checked and put in one normal form, for comparison and for the chat template.

A bad request is a `GatewayError`: the HTTP status (400) and OpenAI's error fields (``message`` naming
the field and the fix, ``param``, ``code``). Messages are compared in a normal form, so the assistant
message an agent sends back matches the one the gateway returned whether the agent echoes the response
object (``content: None``, ``refusal: None``, ``tool_calls`` with JSON-string arguments) or writes a dict.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")


class GatewayError(Exception):
    """A request the gateway refuses, with OpenAI's error fields."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = message, param, code, status, kind


@dataclass(frozen=True)
class Message:
    """One chat message in normal form: ``tool_calls`` as (name, arguments as sorted JSON) pairs."""

    role: str
    content: str
    tool_calls: tuple[tuple[str, str], ...] = ()
    tool_call_id: str | None = None  # a tool message's: the call it answers
    name: str | None = None

    def for_template(self, call_names: dict[str, str]) -> dict[str, Any]:
        """The message as chat templates take it (arguments as dicts, a tool message's function name)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [{"type": "function", "function": {"name": name, "arguments": json.loads(args)}}
                                 for name, args in self.tool_calls]
        if self.role == "tool":
            name = self.name or call_names.get(self.tool_call_id or "")
            if name:
                out["name"] = name
        return out


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise GatewayError(f"{where}.content: a string or a list of content parts, got {type(content).__name__}",
                           param=f"{where}.content")
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("image_url", "input_image", "image", "input_audio", "file"):
            raise GatewayError(f"{where}.content[{k}]: {kind} parts are not supported yet (text only until the"
                               " gateway serves vision models); send the text parts alone",
                               param=f"{where}.content[{k}]", code="unsupported_content")
        if kind != "text" or not isinstance(part.get("text"), str):
            raise GatewayError(f"{where}.content[{k}]: give {{\"type\": \"text\", \"text\": \"...\"}}",
                               param=f"{where}.content[{k}]")
        texts.append(part["text"])
    return "".join(texts)


def _arguments(raw: Any, where: str) -> str:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as err:
            raise GatewayError(f"{where}.arguments: not valid JSON ({err.msg}); send the arguments the response"
                               " gave", param=where) from None
    if not isinstance(raw, dict):
        raise GatewayError(f"{where}.arguments: a JSON object, got {type(raw).__name__}", param=where)
    return json.dumps(raw, sort_keys=True)


def parse_messages(body: Any) -> list[Message]:
    """``messages`` of a chat request in normal form; GatewayError for a malformed one."""
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise GatewayError("messages: a non-empty list of {\"role\": ..., \"content\": ...} objects",
                           param="messages")
    out = []
    for k, m in enumerate(raw):
        where = f"messages[{k}]"
        if not isinstance(m, dict):
            raise GatewayError(f"{where}: an object with role and content, got {type(m).__name__}", param=where)
        role = m.get("role")
        if role not in ROLES:
            raise GatewayError(f"{where}.role: {role!r}; use one of {', '.join(ROLES)}", param=f"{where}.role")
        if role != "assistant" and "content" not in m:
            raise GatewayError(f"{where}: a {role} message needs content", param=f"{where}.content")
        calls = []
        for j, call in enumerate(m.get("tool_calls") or []):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise GatewayError(f"{where}.tool_calls[{j}]: give {{\"type\": \"function\", \"function\": "
                                   "{\"name\": ..., \"arguments\": \"{...}\"}}", param=f"{where}.tool_calls[{j}]")
            calls.append((fn["name"], _arguments(fn.get("arguments", {}), f"{where}.tool_calls[{j}].function")))
        if role == "tool" and not isinstance(m.get("tool_call_id", ""), str):
            raise GatewayError(f"{where}.tool_call_id: a string", param=f"{where}.tool_call_id")
        out.append(Message("system" if role == "developer" else role, _text(m.get("content"), where),
                           tuple(calls), m.get("tool_call_id") if role == "tool" else None,
                           m.get("name") if isinstance(m.get("name"), str) else None))
    return out


def parse_tools(body: Any) -> list[dict[str, Any]] | None:
    """``tools``: OpenAI function schemas, checked; None when the request has none."""
    tools = body.get("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise GatewayError("tools: a list of {\"type\": \"function\", \"function\": {...}} objects", param="tools")
    for k, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise GatewayError(f"tools[{k}]: give {{\"type\": \"function\", \"function\": {{\"name\": ...,"
                               " \"parameters\": {...}}}}", param=f"tools[{k}]")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise GatewayError(f"tools[{k}].function.name: a non-empty string", param=f"tools[{k}].function.name")
        params = fn.get("parameters", {})
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise GatewayError(f"tools[{k}].function.parameters: a JSON schema object ({{\"type\": \"object\","
                               " \"properties\": {...}})", param=f"tools[{k}].function.parameters")
    return tools


def reply_message(content: str, calls: list[tuple[str, dict[str, Any]]]) -> Message:
    """The normal form of the assistant message the gateway returns."""
    return Message("assistant", content, tuple((name, json.dumps(args, sort_keys=True)) for name, args in calls))


def same_turn(sent: Message, recorded: Message) -> bool:
    """Whether an assistant message sent back is the one returned (tool-call ids and whitespace around a
    content that only accompanies tool calls do not count)."""
    if sent.role != recorded.role or sent.tool_calls != recorded.tool_calls:
        return False
    if sent.tool_calls:
        return sent.content.strip() == recorded.content.strip()
    return sent.content == recorded.content
