"""A run whose rewards all fail stops, instead of training on zeros and exiting 0: each such step
trains on nothing, and rollout.max_failed_steps of them in a row fail the run with the reward's error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slime_rl.core.config import RunFailedError, load_config
from slime_rl.core.loop import train


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["zero", "drop"])
def test_a_run_whose_rewards_all_fail_stops_after_max_failed_steps(policy, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))  # the reward workers import hanging_rewards
    monkeypatch.setenv("SLIME_RL_TORCH_THREADS", "1")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input": f"def f{i}(", "label": ""}) + "\n" for i in range(40)))
    cfg = load_config(None, [
        f"model.path={tiny_model_dir}", f"data.prompt_data={prompts}", "data.rollout_batch_size=2",
        "data.n_samples_per_prompt=2", "data.num_rollout=8", "rollout.max_response_len=4",
        "rollout.reward=hanging_rewards:always_raises", f"rollout.on_reward_failure={policy}",
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
    if policy == "zero":  # the failed samples are on record, with the reason
        saved = [json.loads(line) for line in (tmp_path / "run" / "rollouts" / "step_000001.jsonl").read_text()
                 .splitlines()]
        assert len(saved) == 4 and all(s["status"] == "failed" and "ConnectionError" in s["metadata"]["error"]
                                       for s in saved)
