"""examples/agent_tool_math.yaml checks out, and its problems are what examples/data/make_agent_math.py writes."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path

import pytest

from slime_rl.core.config import ConfigError, load_config
from slime_rl.core.rewards import load_reward
from slime_rl.core.sample import Sample

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _generator():
    spec = importlib.util.spec_from_file_location("make_agent_math", EXAMPLES / "data" / "make_agent_math.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_agent_example_config_and_data():
    cfg = load_config(EXAMPLES / "agent_tool_math.yaml", [])
    assert (cfg.rollout.generate_fn, cfg.rollout.tools, cfg.rollout.sglang.router_policy) == ("multi_turn", ["python"],
                                                                                      "manual")
    make = _generator()
    for name, n, seed in (("agent_math.jsonl", 256, 0), ("agent_math_eval.jsonl", 32, 1)):
        rows = [json.loads(line) for line in (EXAMPLES / "data" / name).read_text().splitlines()]
        assert rows == make.records(n, seed), f"examples/data/{name} is stale: run make_agent_math.py"
    # the built-in math reward reads the labels as the model is asked to answer
    reward = load_reward("math", group=False, reward_url=None)
    row = rows[0]
    right = Sample(response=f"The tool printed it. \\boxed{{{row['label']}}}", label=row["label"])
    wrong = Sample(response=f"\\boxed{{{int(row['label']) + 1}}}", label=row["label"])
    assert asyncio.run(_score(reward, right)) == 1.0 and asyncio.run(_score(reward, wrong)) == 0.0


async def _score(reward, sample):
    out = reward(sample)
    return await out if asyncio.iscoroutine(out) else out


def test_agent_example_wires_with_the_sandbox_or_names_what_is_missing():
    from slime_rl.cli.app import check_user_function

    cfg = load_config(EXAMPLES / "agent_tool_math.yaml", [])
    if importlib.util.find_spec("slime_rl.core.sandbox") is None:
        from slime_rl.core.infra.plugins import PluginError

        with pytest.raises(PluginError, match="the built-in `python` tool needs slime_rl.core.sandbox"):
            check_user_function(cfg, "rollout.generate_fn", "multi_turn")
    else:
        check_user_function(cfg, "rollout.generate_fn", "multi_turn")
    with pytest.raises(ConfigError, match="rollout.tools"):
        load_config(EXAMPLES / "agent_tool_math.yaml", ["rollout.generate_fn=null"])
