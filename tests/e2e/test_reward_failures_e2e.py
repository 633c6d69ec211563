"""A run whose rewards all fail stops, instead of training on zeros and exiting 0: each such step
trains on nothing, and rollout.max_failed_steps of them in a row fail the run with the reward's error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slime_rl.core.config import RunFailedError, load_config
from slime_rl.core.run.loop import train


@pytest.mark.slow
def test_a_run_whose_rewards_all_fail_stops_after_max_failed_steps(tiny_model_dir, tmp_path, monkeypatch):
    """on_reward_failure=zero: the failed samples would train (on reward 0) if nothing stopped them."""
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[1] / "support"))  # the reward workers import hanging_rewards
    monkeypatch.setenv("SLIME_RL_TORCH_THREADS", "1")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input": f"def f{i}(", "label": ""}) + "\n" for i in range(40)))
    cfg = load_config(None, [
        f"model.path={tiny_model_dir}", f"data.prompt_data={prompts}", "data.rollout_batch_size=2",
        "data.n_samples_per_prompt=2", "data.num_rollout=8", "rollout.max_response_len=4",
        "rollout.reward=hanging_rewards:always_raises", "rollout.on_reward_failure=zero",
        "rollout.max_failed_steps=2", "cluster.device=cpu", "checkpoint.save_interval=1",
        f"logging.dir={tmp_path / 'run'}", "logging.tensorboard=false", "logging.save_rollouts=true",
    ])
    with pytest.raises(RunFailedError) as failed:
        train(cfg)
    message = str(failed.value)
    assert "\n" not in message
    assert message.startswith("rollout.max_failed_steps: 2 steps in a row failed (the last, step 2: 4 of 4 samples "
                              "failed, more than rollout.max_failed_fraction=0.5; the first: reward "
                              "'hanging_rewards:always_raises' raised ConnectionError: judge server at "
                              "http://judge:8000 refused the connection)")
    assert message.endswith("or raise rollout.max_failed_fraction or rollout.max_failed_steps")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["rollout/step_failed"]) for r in rows] == [(1, 1.0), (2, 1.0)]
    assert not any(key.startswith("train/") for r in rows for key in r)  # nothing was trained on
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())
    # the failed samples are on record, with the reason
    saved = [json.loads(line) for line in (tmp_path / "run" / "rollouts" / "step_000001.jsonl").read_text()
             .splitlines()]
    assert len(saved) == 4 and all(s["status"] == "failed" and "ConnectionError" in s["metadata"]["error"]
                                   for s in saved)


@pytest.mark.slow
def test_slime_cli_exits_1_with_the_rewards_error_in_one_line(tiny_model_dir, tmp_path):
    """on_reward_failure=drop, through slime-cli: every group dropped, the step still fails."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input": f"def f{i}(", "label": ""}) + "\n" for i in range(40)))
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({  # JSON is YAML
        "model": {"path": str(tiny_model_dir)},
        "data": {"prompt_data": str(prompts), "rollout_batch_size": 2, "n_samples_per_prompt": 2, "num_rollout": 8},
        "rollout": {"max_response_len": 4, "reward": "hanging_rewards:always_raises", "on_reward_failure": "drop"},
        "cluster": {"device": "cpu"}, "logging": {"dir": str(tmp_path / "run"), "tensorboard": False},
    }))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "support"), "SLIME_RL_TORCH_THREADS": "1"}
    cli = Path(sys.executable).with_name("slime-cli")
    done = subprocess.run([str(cli), "train", str(config)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: rollout.max_failed_steps: 3 steps in a row failed (the last, step 3: ")
    assert "reward 'hanging_rewards:always_raises' raised ConnectionError: judge server" in last
    assert "Traceback" not in done.stderr
    # each failed step said why as it happened, not only at the end
    assert done.stdout.count("failed, not trained on: 4 of 4 samples failed") == 3
