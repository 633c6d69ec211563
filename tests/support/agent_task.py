"""The toy tool task of the agent end-to-end test: a tool and the reward, loaded by ``module:attr``."""

from __future__ import annotations

from slime_rl.core.sample import Sample

SECRET = "42"
PROMPT = "Find the secret number."
CALL = '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>'
ANSWER = "The secret is 42."


def lookup() -> str:
    """Look up the secret number."""
    return SECRET


def used_tool_then_answered(sample: Sample) -> float:
    """1 when the episode called the tool successfully and then answered: the task takes at least two turns."""
    m = sample.metadata
    return float(m["tool_calls"] - m["tool_errors"] >= 1 and m["episode_end"] == "final_answer")
