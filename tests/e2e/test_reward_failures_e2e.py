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
from slime_rl.core.infra.net import free_port
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


SECRETS = ("sk-e2e-inline-4c1f9a", "sk-e2e-env-7d2b6e", "pw-e2e-url-3a8c5f", "tok-e2e-url-9e4d1b")


def files_holding(folder: Path, secrets: tuple[str, ...]) -> list[str]:
    """Every file under ``folder`` (checkpoints, rollouts, logs, metrics) that holds one of ``secrets``."""
    return [f"{p}: {s}" for p in folder.rglob("*") if p.is_file() for s in secrets if s.encode() in p.read_bytes()]


@pytest.mark.slow
def test_slime_cli_exits_1_with_the_rewards_error_in_one_line(tiny_model_dir, tmp_path):
    """Through slime-cli, every sample failing (scored 0, on record in rollouts/), the step still fails. The reward is
    ``remote`` at a dead port, with a key in the config and credentials in its URL (issue 34, secrets):
    none of them shows in any file of the run, in its output or in the config it prints."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input": f"def f{i}(", "label": ""}) + "\n" for i in range(40)))
    port = free_port()  # nothing listens there
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({  # JSON is YAML
        "model": {"path": str(tiny_model_dir)},
        "data": {"prompt_data": str(prompts), "rollout_batch_size": 2, "n_samples_per_prompt": 2, "num_rollout": 8},
        "rollout": {"max_response_len": 4, "reward": "remote", "on_reward_failure": "zero",
                    "reward_url": f"http://judge:{SECRETS[2]}@127.0.0.1:{port}/score?token={SECRETS[3]}",
                    "reward_api_key": SECRETS[0]},
        "cluster": {"device": "cpu"},
        "logging": {"dir": str(tmp_path / "run"), "tensorboard": True, "save_rollouts": True},
    }))
    env = {**os.environ, "SLIME_RL_TORCH_THREADS": "1", "E2E_REWARD_KEY": SECRETS[1]}
    cli = Path(sys.executable).with_name("slime-cli")
    done = subprocess.run([str(cli), "train", str(config)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: rollout.max_failed_steps: 3 steps in a row failed (the last, step 3: ")
    assert (f"reward 'remote' raised RemoteRewardError: remote reward http://<redacted>@127.0.0.1:{port}/score?"
            "token=<redacted>: no answer after 3 tries") in last
    assert "Traceback" not in done.stderr
    # each failed step said why as it happened, not only at the end
    assert done.stdout.count("failed, not trained on: 4 of 4 samples failed") == 3
    saved = [json.loads(line) for line in (tmp_path / "run" / "rollouts" / "step_000001.jsonl").read_text()
             .splitlines()]
    assert saved and all("RemoteRewardError" in s["metadata"]["error"] for s in saved)
    assert not [s for s in SECRETS if s in done.stdout + done.stderr]
    assert files_holding(tmp_path / "run", SECRETS) == []
    # the key by reference: the printed config holds the reference, never the value
    plan = subprocess.run([str(cli), "plan", str(config), "rollout.reward_api_key=env:E2E_REWARD_KEY"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0 and "env:E2E_REWARD_KEY" in plan.stdout, plan.stderr[-2000:]
    assert not [s for s in SECRETS if s in plan.stdout + plan.stderr]
