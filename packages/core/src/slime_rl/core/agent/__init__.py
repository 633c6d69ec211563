"""Agentic multi-turn rollouts: the built-in ``multi_turn`` generate function, tools, tool-call
parsing, chat-template turn rendering and the template parity check (docs/agents.md)."""

from slime_rl.core.agent.generate import EPISODE_ENDS, MultiTurnGenerate
from slime_rl.core.agent.template import TemplateError, TurnTemplate
from slime_rl.core.agent.tool_calls import ToolCall, parse_tool_calls
from slime_rl.core.agent.tools import Tool, ToolResult, call_tool, load_tools, tool_schemas

__all__ = ["EPISODE_ENDS", "MultiTurnGenerate", "TemplateError", "Tool", "ToolCall", "ToolResult", "TurnTemplate",
           "call_tool", "load_tools", "parse_tool_calls", "tool_schemas"]
