"""Vision-language RL end to end on CPU through `slime-cli train` (issue 41's acceptance): a tiny random
Qwen2.5-VL (slime_rl.core.testing.tiny_vl_model_folder) on the Megatron trainer and the transformers engine
learns the synthetic colour task (slime_rl.core.testing.shapes: one shape in a 56 x 56 picture, the answer the
colour's number, the same prompt text for every record) to a held-out accuracy of at least twice chance; the
same run on blank pictures (same prompts, same labels) stays at chance: the policy learns from the images.

Held-out accuracy is the eval set's mean reward: its records ask `digit_reward_shaped` for the plain 0/1, and
eval decodes greedily. Training uses the shaped reward (a random model would not write the right digit often
enough to learn from 0/1 alone). ~3.5 minutes on the 2-core machine, the two runs side by side."""

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


def _start(tmp_path: Path, model: Path, data: Path, name: str) -> subprocess.Popen:
    """A training run of ``data`` in the background (the two runs of the test share the 2 cores: each is a
    chain of single-threaded steps, so side by side they take about as long as one)."""
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
    with (tmp_path / f"{name}.log").open("w") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen([str(cli), "train", str(config), *overrides], stdout=log, stderr=subprocess.STDOUT,
                                env=env)


def _finish(run: subprocess.Popen, tmp_path: Path, name: str) -> list[dict]:
    try:
        code = run.wait(timeout=900)
    except subprocess.TimeoutExpired:
        run.kill()
        raise
    assert code == 0, (tmp_path / f"{name}.log").read_text()[-5000:]
    metrics = next((tmp_path / name).rglob("metrics.jsonl"))
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def _heldout(rows: list[dict]) -> list[float]:
    return [r["eval/heldout/reward_mean"] for r in rows if "eval/heldout/reward_mean" in r]


@pytest.mark.heavy  # ~6 min on 2 cores: started first (tests/conftest.py)
def test_a_tiny_qwen2_5_vl_learns_the_colour_task_and_the_blank_control_does_not(tmp_path):
    from slime_rl.core.testing import tiny_vl_model_folder
    from slime_rl.core.testing.shapes import write_shapes_data

    model = tiny_vl_model_folder(tmp_path / "tiny-vl")
    sets = {}
    for name, blank in (("shapes", False), ("blank", True)):
        write_shapes_data(tmp_path / name, n=512, seed=1, task="colour_number", name="train", blank=blank)
        sets[name] = write_shapes_data(tmp_path / name, n=128, seed=2, task="colour_number", name="heldout",
                                       blank=blank, strict=True)

    runs = {name: _start(tmp_path, model, tmp_path / name, f"run-{name}") for name in sets}
    try:
        learned, control = (_heldout(_finish(runs[name], tmp_path, f"run-{name}")) for name in ("shapes", "blank"))
    finally:
        for run in runs.values():
            if run.poll() is None:  # the other run failed first
                run.kill()
    assert len(learned) == 4 and learned[0] <= CHANCE, learned  # evals at steps 0, 50, 100, 150
    assert learned[-1] >= 2 * CHANCE, learned

    # Every blank held-out record is the same input, so greedy decoding gives one answer for all of them: its
    # accuracy is that label's share, at most the commonest label's, which is chance with four balanced labels.
    labels = Counter(json.loads(line)["label"] for line in sets["blank"].read_text().splitlines())
    assert max(labels.values()) / 128 <= 0.35, labels
    assert all(acc <= max(labels.values()) / 128 + 1e-9 for acc in control), (control, labels)
    print(f"held-out accuracy, steps 0/50/100/150: shapes {learned}, blank control {control}")
