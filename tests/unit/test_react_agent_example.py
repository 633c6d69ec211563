"""examples/react_agent: its config checks out, its problems are what make_data.py writes, and the agent's calculator
and the task's reward do what they say."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from slime_rl.core.config import load_config
from slime_rl.core.sample import Sample

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "react_agent"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_config_and_data():
    sys.path.insert(0, str(EXAMPLE))
    try:
        cfg = load_config(EXAMPLE / "react_agent.yaml", [])
    finally:
        sys.path.remove(str(EXAMPLE))
    assert (cfg.rollout.generate_fn, cfg.rollout.gateway.agent, cfg.rollout.reward) == (
        "gateway", "react_agent:run", "react_agent:reward")
    make = _module("make_data")
    for name, n, seed in (("problems.jsonl", 256, 0), ("problems_eval.jsonl", 32, 1)):
        rows = [json.loads(line) for line in (EXAMPLE / "data" / name).read_text().splitlines()]
        assert rows == make.records(n, seed), f"examples/react_agent/data/{name} is stale: run make_data.py"


def test_calculator_and_reward():
    agent = _module("react_agent")
    assert agent.calculator("6 * 7 + 8 * 9") == "114" and agent.calculator("2 ** 99").startswith("error")
    assert agent.calculator("__import__('os')").startswith("error")
    question = "What is 6 * 7 + 8 * 9?"
    shown = Sample(prompt=question, label="114", metadata={"agent_result": {"answer": 114, "computed": ["6*7", "8*9"]}})
    guessed = Sample(prompt=question, label="114", metadata={"agent_result": {"answer": 114, "computed": ["6*7"]}})
    wrong = Sample(prompt=question, label="114", metadata={"agent_result": {"answer": 113, "computed": ["6*7", "8*9"]}})
    assert [agent.reward(s) for s in (shown, guessed, wrong)] == [1.0, 0.0, 0.0]
