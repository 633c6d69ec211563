"""Write agent_math.jsonl / agent_math_eval.jsonl: arithmetic word problems (in the spirit of reasoning-gym's
basic_arithmetic and word-problem tasks) that a small model solves best by running Python, offline and seeded.

    python examples/data/make_agent_math.py            # rewrites the two files next to this script

Each record: ``input`` (chat messages: a system prompt that says how to call the tool, and the problem),
``label`` (the answer as an integer string, for the built-in ``math`` reward) and ``tools`` (the `python`
tool's schema, which the chat template renders into the prompt).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SYSTEM = ("You solve math problems. You may run Python by writing <tool_call>{\"name\": \"python\", \"arguments\": "
          "{\"code\": \"print(...)\"}}</tool_call>; you will see what it prints. Give the final answer as "
          "\\boxed{N}.")
PYTHON_TOOL = {"type": "function", "function": {
    "name": "python", "description": "Run Python code in a sandbox and return what it prints.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "the program"}},
                   "required": ["code"]}}}


def problem(rng: random.Random) -> tuple[str, int]:
    kind = rng.randrange(5)
    if kind == 0:
        a, b = rng.randint(12, 99), rng.randint(12, 99)
        c = rng.randint(1, a * b - 1)
        return f"A farmer has {a} crates of {b} apples each and sells {c} apples. How many apples are left?", a * b - c
    if kind == 1:
        a, b, c, d = rng.randint(100, 999), rng.randint(10, 99), rng.randint(1, 999), rng.randint(7, 97)
        return f"What is ({a} * {b} + {c}) mod {d}?", (a * b + c) % d
    if kind == 2:
        a, b, c, d = rng.randint(40, 120), rng.randint(2, 9), rng.randint(40, 120), rng.randint(2, 9)
        return (f"A train runs at {a} km/h for {b} hours, then at {c} km/h for {d} hours. How many km does it"
                " travel?"), a * b + c * d
    if kind == 3:
        a, b = rng.randint(1000, 9999), rng.randint(100, 999)
        return f"What is the sum of the digits of {a} * {b}?", sum(int(ch) for ch in str(a * b))
    lo = rng.randint(1, 500)
    hi, k = lo + rng.randint(100, 2000), rng.randint(3, 17)
    return f"How many integers from {lo} to {hi} inclusive are divisible by {k}?", hi // k - (lo - 1) // k


def records(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        question, answer = problem(rng)
        out.append({"input": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                    "label": str(answer), "tools": [PYTHON_TOOL]})
    return out


def write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    write(HERE / "agent_math.jsonl", records(256, seed=0))
    write(HERE / "agent_math_eval.jsonl", records(32, seed=1))
