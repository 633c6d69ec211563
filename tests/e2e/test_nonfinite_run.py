"""Through the loop and Ray: a step with nan advantages is skipped and counted, the run goes on and
saves finite weights; with trainer.on_nonfinite=stop the run fails naming the step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slime_rl.core.config import load_config
from slime_rl.core.run import checkpoint
from slime_rl.core.run.loop import train


def overrides(tiny_model_dir, tmp_path, *extra):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input": f"x{i} = ", "label": str(i)}) + "\n" for i in range(12)))
    return [f"model.path={tiny_model_dir}", f"data.prompt_data={prompts}", "data.rollout_batch_size=2",
            "data.n_samples_per_prompt=4", "data.num_rollout=3", "rollout.max_response_len=4",
            "rollout.reward=toy_rewards:digit_token_fraction", "trainer.backend=nonfinite_trainer:NanAdvantagesAtStepTwo",
            "trainer.lr=0.01", "cluster.device=cpu", f"logging.dir={tmp_path / 'run'}", "logging.tensorboard=false",
            "checkpoint.save_interval=1", *extra]


@pytest.fixture(autouse=True)
def ray_workers_import_the_test_plugins(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("TOY_TOKENIZER", str(tiny_model_dir))
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[1] / "support"))
    monkeypatch.setenv("SLIME_RL_TORCH_THREADS", "1")


@pytest.mark.slow
def test_a_nan_step_is_skipped_counted_and_never_saved(tiny_model_dir, tmp_path):
    summary = train(load_config(None, overrides(tiny_model_dir, tmp_path)))
    assert summary["steps"] == 3
    rows = [json.loads(line) for line in Path(summary["metrics_file"]).read_text().splitlines()]
    steps = [r for r in rows if "train/nonfinite_skipped" in r]
    assert [r["train/nonfinite_skipped"] for r in steps] == [0.0, 1.0, 0.0]
    assert [r["train/weights_finite"] for r in steps] == [1.0, 1.0, 1.0]
    folder, meta = checkpoint.resume_point(tmp_path / "run" / "checkpoints")  # every save verifies
    assert meta["step"] == 3


@pytest.mark.slow
def test_on_nonfinite_stop_fails_the_run_at_that_step(tiny_model_dir, tmp_path):
    """Through slime-cli: exit 1, and the last line says what happened and what to do."""
    import os
    import subprocess
    import sys

    config = tmp_path / "run.yaml"
    config.write_text("{}\n")  # everything from the overrides
    cli = Path(sys.executable).parent / "slime-cli"
    done = subprocess.run([str(cli), "train", str(config),
                           *overrides(tiny_model_dir, tmp_path, "trainer.on_nonfinite=stop", "logging.progress_bar=false")],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stderr.splitlines()[-1] == (
        "error: training failed: NonFiniteError: trainer.on_nonfinite=stop: optimizer step 2 (actor) has a"
        " non-finite loss (nan); the update was not applied. Look for inf/nan in the rewards and advantages or"
        " lower trainer.lr; trainer.on_nonfinite=skip skips such steps instead")
    _, meta = checkpoint.resume_point(tmp_path / "run" / "checkpoints")
    assert meta["step"] == 1  # the last good step; nothing of step 2 was saved
