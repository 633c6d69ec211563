"""Images through the whole loop to the Megatron trainer (issue 41): `slime-cli train` on a tiny random Qwen2.5-VL
with the shapes data, the hf engine rolling out on the CPU and the Megatron trainer scoring and training, one
and two data-parallel ranks. At every step the trainer's log-probs of the sampled tokens equal the engine's
(<= 1e-4, both fp32): only possible when the trainer saw each sample's images, at the engine's positions, and
after the first update only when the sync carried the trained vision tower and language model to the engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slime_rl.core.testing.shapes import write_shapes_data
from slime_rl.core.testing.vision import tiny_vl_model_folder

SUPPORT = Path(__file__).parents[1] / "support"


@pytest.mark.parametrize("ranks", [1, 2])
def test_images_reach_the_trainer_and_its_log_probs_are_the_engines(tmp_path, ranks):
    model = tiny_vl_model_folder(tmp_path / "model")
    data = write_shapes_data(tmp_path / "data", n=16, seed=0, task="colour")
    config = tmp_path / "config.yaml"
    config.write_text(f"model: {{path: {model}, dtype: float32}}\nlogging: {{dir: {tmp_path / 'run'}}}\n")
    args = [f"data.prompt_data={data}", "data.input_key=input", "data.label_key=label", "data.image_key=images",
            "data.apply_chat_template=true", "data.rollout_batch_size=2", "data.n_samples_per_prompt=4",
            "data.num_rollout=3", "rollout.engine=hf", "rollout.max_response_len=4",
            "rollout.reward=toy_rewards:odd_index",  # rewards that differ in every group: every step trains
            "trainer.backend=megatron", "trainer.lr=0.01", "cluster.device=cpu",
            f"cluster.actor_num_gpus_per_node={ranks}", "logging.tensorboard=false", "logging.progress_bar=false"]
    env = {**os.environ, "PYTHONPATH": str(SUPPORT), "SLIME_RL_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "slime_rl.cli.app", "train", str(config), *args], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "train/train_rollout_logprob_abs_diff" in s]
    assert len(steps) == 3
    assert all(s["train/grad_norm"] > 0 for s in steps)  # the vision tower and LM train
    assert all(s["train/train_rollout_logprob_abs_diff"] <= 1e-4 for s in steps), [
        s["train/train_rollout_logprob_abs_diff"] for s in steps]
