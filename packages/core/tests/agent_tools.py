"""Tools for the agent tests, loaded by ``module:attr`` like a user's."""

from __future__ import annotations

import asyncio
import time


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


async def slow_echo(text: str) -> str:
    """Echo after a pause (an async tool)."""
    await asyncio.sleep(0.01)
    return text


def explode() -> str:
    raise RuntimeError("the tool broke")


def hang() -> str:
    time.sleep(3)  # longer than the tests' tool_timeout; the thread ends on its own
    return "never seen"


async def hang_async() -> str:
    await asyncio.sleep(3600)
    return "never seen"


not_callable = 42
