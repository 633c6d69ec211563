"""Vision-language RL end to end on CPU through `slime-cli train` (issue 41's acceptance): a tiny random
Qwen2.5-VL (slime_rl.core.testing.tiny_vl_model_folder) on the Megatron trainer and the transformers engine
learns the synthetic colour task (slime_rl.core.testing.shapes: one shape in a 56 x 56 picture, the answer the
colour's number, the same prompt text for every record) to a held-out accuracy of at least twice chance; the
same run on blank pictures (same prompts, same labels) stays at chance: the policy learns from the images.

Held-out accuracy is the eval set's mean reward: its records ask `digit_reward_shaped` for the plain 0/1, and
eval decodes greedily. Training uses the shaped reward (a random model would not write the right digit often
enough to learn from 0/1 alone). ~3.5 minutes a run on the 2-core machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("PIL")

STEPS = 150
CHANCE = 0.25


def _train(tmp_path: Path, model: Path, data: Path, name: str) -> list[dict]:
    config = tmp_path / "run.yaml"
    config.write_text("{}\n")
    overrides = [
        f"model.path={model}", f"data.prompt_data={data / 'train.jsonl'}", "data.image_key=images",
        "data.apply_chat_template=true", f"eval.prompt_data.heldout={data / 'heldout.jsonl'}", "eval.interval=50",
        "data.rollout_batch_size=16", "data.n_samples_per_prompt=16", f"data.num_rollout={STEPS}",
        "rollout.max_response_len=1", "rollout.temperature=1.0",
        "rollout.reward=slime_rl.core.testing.shapes:digit_reward_shaped",
        "trainer.lr=0.003", "cluster.device=cpu", "model.dtype=float32",
        f"logging.dir={tmp_path / name}", "logging.tensorboard=false", "logging.progress_bar=false",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SLIME_RL_TORCH_THREADS": "1"}
    cli = Path(sys.executable).parent / "slime-cli"
    done = subprocess.run([str(cli), "train", str(config), *overrides], capture_output=True, text=True,
                          timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-5000:]
    metrics = next((tmp_path / name).rglob("metrics.jsonl"))
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def _heldout(rows: list[dict]) -> list[float]:
    return [r["eval/heldout/reward_mean"] for r in rows if "eval/heldout/reward_mean" in r]


def test_a_tiny_qwen2_5_vl_learns_the_colour_task_and_the_blank_control_does_not(tmp_path):
    from slime_rl.core.testing import tiny_vl_model_folder
    from slime_rl.core.testing.shapes import write_shapes_data

    model = tiny_vl_model_folder(tmp_path / "tiny-vl")
    sets = {}
    for name, blank in (("shapes", False), ("blank", True)):
        write_shapes_data(tmp_path / name, n=512, seed=1, task="colour_number", name="train", blank=blank)
        sets[name] = write_shapes_data(tmp_path / name, n=128, seed=2, task="colour_number", name="heldout",
                                       blank=blank, strict=True)

    learned = _heldout(_train(tmp_path, model, tmp_path / "shapes", "run-shapes"))
    assert len(learned) == 4 and learned[0] <= CHANCE, learned  # evals at steps 0, 50, 100, 150
    assert learned[-1] >= 2 * CHANCE, learned

    control = _heldout(_train(tmp_path, model, tmp_path / "blank", "run-blank"))
    # Every blank held-out record is the same input, so greedy decoding gives one answer for all of them: its
    # accuracy is that label's share, at most the commonest label's, which is chance with four balanced labels.
    labels = Counter(json.loads(line)["label"] for line in sets["blank"].read_text().splitlines())
    assert max(labels.values()) / 128 <= 0.35, labels
    assert all(acc <= max(labels.values()) / 128 + 1e-9 for acc in control), (control, labels)
    print(f"held-out accuracy, steps 0/50/100/150: shapes {learned}, blank control {control}")
