"""A text ReAct agent with a calculator, written against the OpenAI API and nothing else: slime-rl trains the model
under it as it is (rollout.generate_fn: gateway; docs/agents.md, "Train an agent as it is").

Each model reply is one line, ``Action: calculator[<expression>]`` or ``Answer: <number>``. The agent runs the
calculator and answers with ``Observation: <result>`` as a user turn, so any chat template carries it (SmolLM2's
ignores ``tools``; nothing here needs them). The problems (make_data.py) add two products, ``a * b + c * d``, and
the task's rule is to show the work: an answer counts when it is right and came after the calculator computed
both products (`reward`).

    slime-cli train examples/react_agent/react_agent.yaml        # from the repo root; PYTHONPATH=examples/react_agent
"""

from __future__ import annotations

import ast
import operator
import os
import re
from typing import Any

import openai

SYSTEM = ("You solve arithmetic with a calculator. Reply with exactly one line: either\n"
          "Action: calculator[<expression>]\n"
          "to compute something (you will see the Observation), or\n"
          "Answer: <number>\n"
          "when you know the result. Compute each product with the calculator before you answer.")
ACTION = re.compile(r"Action:\s*calculator\[(.+?)\]")
ANSWER = re.compile(r"Answer:\s*(-?\d+)")
MAX_STEPS = 8  # model calls per episode
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod, ast.USub: operator.neg}


def calculator(expression: str) -> str:
    """Integer arithmetic (+ - * // %) on literals; anything else is an error message, as a tool gives one."""
    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError("only integers and + - * // %")
    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError) as err:
        return f"error: {err}"


async def run(base_url: str, api_key: str, sample: Any) -> dict[str, Any]:
    """One episode on ``sample.prompt`` (the question); returns its final state for `reward`."""
    question = sample.prompt if isinstance(sample.prompt, str) else sample.prompt[-1]["content"]
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key) as client:
        model = os.environ.get("REACT_AGENT_MODEL") or (await client.models.list()).data[0].id
        messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        computed: list[str] = []
        for _ in range(MAX_STEPS):
            reply = await client.chat.completions.create(model=model, messages=messages, max_tokens=48)
            text = reply.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": text})
            if (answer := ANSWER.search(text)) is not None:
                return {"answer": int(answer.group(1)), "computed": computed}
            action = ACTION.search(text)
            result = calculator(action.group(1)) if action else "error: write Action: calculator[...] or Answer: N"
            if action and not result.startswith("error"):
                computed.append(action.group(1).replace(" ", ""))
            messages.append({"role": "user", "content": f"Observation: {result}"})
    return {"answer": None, "computed": computed}


def products(question: str) -> list[str]:
    """The products a question adds: ``What is 6 * 7 + 8 * 9?`` -> ``["6*7", "8*9"]``."""
    return [f"{a}*{b}" for a, b in re.findall(r"(\d+)\s*\*\s*(\d+)", question)]


def reward(sample: Any) -> float:
    """1 when the answer is right and the calculator computed every product of the question before it; else 0."""
    state = sample.metadata.get("agent_result") or {}
    question = sample.prompt if isinstance(sample.prompt, str) else sample.prompt[-1]["content"]
    shown = set(products(question)) <= set(state.get("computed", []))
    return float(shown and state.get("answer") is not None and str(state["answer"]) == str(sample.label))
