"""Write data/problems.jsonl and data/problems_eval.jsonl: ``What is a * b + c * d?``, offline and seeded.

    python examples/react_agent/make_data.py

Each record: ``input`` (the question as text: the agent writes its own messages) and ``label`` (the sum)."""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent


def records(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b, c, d = (rng.randint(11, 99) for _ in range(4))
        out.append({"input": f"What is {a} * {b} + {c} * {d}?", "label": str(a * b + c * d)})
    return out


if __name__ == "__main__":
    (HERE / "data").mkdir(exist_ok=True)
    for name, n, seed in (("problems.jsonl", 256, 0), ("problems_eval.jsonl", 32, 1)):
        (HERE / "data" / name).write_text("".join(json.dumps(r) + "\n" for r in records(n, seed)))
