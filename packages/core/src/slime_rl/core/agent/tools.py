"""Tools an agent calls: plain Python callables named ``module:attr`` in ``rollout.tools``, or the
built-in sandboxed ``python`` tool.

A tool takes the call's arguments as keyword arguments and returns the observation (a ``str``;
anything else is ``str()``-ed), or ``{"text": ..., "images": [...]}`` for pictures too (a vision-language
model's observation: core/vision/observation.py). ``async def`` tools run on the rollout's event loop; plain ones in a
thread pool of the agent's own, so a slow tool never holds up the loop or the pool the rollout
itself uses. Every call has a timeout (``rollout.tool_timeout``): a tool that raises, hangs or gets
bad arguments gives an ``error: ...`` observation and the episode goes on. A plain function that
hangs keeps its thread until it returns (Python cannot kill a thread): code that can hang belongs
in the sandbox (a separate process per call), which the ``python`` tool uses.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from slime_rl.core.agent.tool_calls import ToolCall
from slime_rl.core.infra.plugins import PluginError, load_attr
from slime_rl.core.vision.observation import tool_images

if TYPE_CHECKING:
    from slime_rl.core.config import Config

BUILTIN_TOOLS = ("python",)
MAX_OBSERVATION_CHARS = 8192  # a tool that prints a novel gives its head and a note, not a context overflow
_THREADS = 32  # plain-function tools running at once; more wait for a thread (under their timeout)


@dataclass
class Tool:
    name: str  # what the model calls it: the attribute's name, or "python"
    fn: Callable[..., Any]
    spec: str  # as rollout.tools gives it


@dataclass
class ToolResult:
    name: str
    text: str  # the observation
    error: bool = False  # raised, timed out, unknown tool or a malformed call
    images: list[str] = field(default_factory=list)  # pictures it returned (paths or data URIs)


def load_tools(specs: list[str], cfg: Config | None = None) -> dict[str, Tool]:
    """``rollout.tools`` loaded: name -> Tool. Raises PluginError ``rollout.tools[i]: <why and the fix>``."""
    tools: dict[str, Tool] = {}
    for i, spec in enumerate(specs):
        field = f"rollout.tools[{i}]"
        if spec == "python":
            tool = Tool("python", _python_tool(cfg), spec)
        elif ":" in spec:
            try:
                fn = load_attr(spec, what="tool")
            except PluginError as err:
                raise PluginError(f"{field}: {err}") from None
            if not callable(fn):
                raise PluginError(f"{field}: {spec!r} is a {type(fn).__name__}, not a callable; name a function")
            tool = Tool(spec.rpartition(":")[2].rsplit(".", 1)[-1], fn, spec)
        else:
            raise PluginError(f"{field}: {spec!r}: give `module:attr` or a built-in tool ({', '.join(BUILTIN_TOOLS)})")
        if tool.name in tools:
            raise PluginError(f"{field}: {spec!r}: a tool named {tool.name!r} is already listed"
                              f" ({tools[tool.name].spec!r}); tool names must differ")
        tools[tool.name] = tool
    return tools


def _python_tool(cfg: Config | None) -> Callable[..., Any]:
    """The sandboxed ``python`` tool under ``rollout.sandbox`` (the defaults without a config)."""
    from slime_rl.core.config import Config
    from slime_rl.core.sandbox import SandboxSettings, make_python_tool

    return make_python_tool(SandboxSettings.from_config(cfg if cfg is not None else Config()))


@functools.cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(_THREADS, thread_name_prefix="agent-tool")


async def call_tool(tools: dict[str, Tool], call: ToolCall, timeout: float) -> ToolResult:
    """Run one call; never raises (except cancellation): every failure is an ``error: ...`` observation."""
    if call.error is not None:
        return ToolResult(call.name, f"error: {call.error}", error=True)
    tool = tools.get(call.name)
    if tool is None:
        known = ", ".join(sorted(tools)) or "none"
        return ToolResult(call.name, f"error: no tool named {call.name!r}; the tools are: {known}", error=True)
    try:
        result = await asyncio.wait_for(_invoke(tool.fn, call.arguments), timeout)
    except asyncio.CancelledError:
        raise
    except TimeoutError:
        return ToolResult(tool.name, f"error: {tool.name} timed out after {timeout:g} s", error=True)
    except Exception as err:  # the tool's own failure, or arguments it does not take
        return ToolResult(tool.name, f"error: {type(err).__name__}: {err}"[:MAX_OBSERVATION_CHARS], error=True)
    try:
        pictures = tool_images(result)
    except ValueError as err:
        return ToolResult(tool.name, f"error: {err}", error=True)
    images: list[str] = []
    if pictures is not None:
        result, images = pictures
    text = result if isinstance(result, str) else str(result)
    if len(text) > MAX_OBSERVATION_CHARS:
        text = text[:MAX_OBSERVATION_CHARS] + f"\n[... {len(text) - MAX_OBSERVATION_CHARS} more characters cut]"
    return ToolResult(tool.name, text, images=images)


async def _invoke(fn: Callable[..., Any], arguments: dict[str, Any]) -> Any:
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__):
        result = await fn(**arguments)
    else:
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(_pool(), functools.partial(fn, **arguments))
    if inspect.isawaitable(result):  # a plain function that hands back a coroutine
        result = await result
    return result


def tool_schemas(tools: dict[str, Tool]) -> list[dict[str, Any]]:
    """The tools as JSON schemas for ``apply_chat_template(tools=...)`` (from signatures and docstrings)."""
    from transformers.utils import get_json_schema

    out = []
    for tool in tools.values():
        try:
            out.append(get_json_schema(tool.fn))
        except Exception:  # no docstring or type hints: a schema with the name only
            out.append({"type": "function", "function": {"name": tool.name, "description": "",
                                                         "parameters": {"type": "object", "properties": {}}}})
        out[-1]["function"]["name"] = tool.name
    return out
