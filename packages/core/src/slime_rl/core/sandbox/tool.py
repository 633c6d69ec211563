"""The sandboxed ``python`` tool for the multi-turn agent: code in, observation text out."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from slime_rl.core.sandbox.run import arun_python
from slime_rl.core.sandbox.settings import SandboxSettings


def make_python_tool(settings: SandboxSettings) -> Callable[[str], Awaitable[str]]:
    """``async def python(code) -> str``: runs ``code`` in the sandbox and returns what a model should
    see (stdout, stderr, and how the call ended when it did not end well). It never raises for what
    the code does; a timeout, a crash or a flood of output is part of the observation."""

    async def python(code: str) -> str:
        """Run Python code in a sandbox (no network, no files outside its scratch directory) and
        return its output. Print what you want to see."""
        return (await arun_python(code, settings)).observation()

    return python
