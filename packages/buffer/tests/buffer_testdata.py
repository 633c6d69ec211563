"""Test data for the buffer tests (a module of its own: `conftest` is ambiguous in a whole-repo run)."""

from __future__ import annotations

import json
from pathlib import Path

from slime_rl.core.sample import Sample, SampleStatus


def write_jsonl(path: Path, rows: list) -> Path:
    """Rows are dicts (written as JSON) or raw strings (written as they are)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def arithmetic_rows(n: int) -> list[dict]:
    return [{"input": f"what is {i} + {i % 7} ?", "label": str(i + i % 7), "metadata": {"row": i}} for i in range(n)]


def finished_group(group_index: int, n: int = 4, *, version: int = 0, rewards: list | None = None,
                   prompt_len: int = 3, response_len: int = 2) -> list[Sample]:
    rewards = rewards if rewards is not None else [float(k % 2) for k in range(n)]
    out = []
    for k in range(n):
        s = Sample(index=group_index * n + k, group_index=group_index, prompt=f"p{group_index}",
                   label=str(group_index), tokens=list(range(prompt_len)), weight_version=version,
                   metadata={"k": k})
        s.append_response([100 + k] * response_len, [-0.5 - k] * response_len, trained=True)
        s.reward, s.status, s.response = rewards[k], SampleStatus.COMPLETED, "ok"
        out.append(s)
    return out
