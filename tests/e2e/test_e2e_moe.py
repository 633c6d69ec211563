"""End to end on CPU through `slime-cli train`: a tiny random Qwen3-MoE, GLM-4.5, DeepSeek-V3 and DeepSeek-V2 (2 layers, 8 experts, top-2) on
the Megatron trainer and the transformers rollout engine learns the toy reward with GRPO, with rollout
routing replay on (the engine's expert choices travel with the samples and the trainer replays them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_e2e_grpo import write_prompts


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe", "deepseek_v3", "deepseek_v2"])
def test_grpo_on_a_tiny_moe_learns_toy_reward(family, tmp_path):
    """GLM-4.5: a dense first layer, sigmoid routing with the correction bias in 2 groups, a shared expert;
    DeepSeek-V3: the same with multi-head latent attention; DeepSeek-V2: MLA with softmax routing, unrenormalised."""
    from slime_rl.core.testing import tiny_model_folder

    model = tiny_model_folder(tmp_path / f"tiny-{family}", family)
    config = tmp_path / "run.yaml"
    config.write_text("{}\n")  # everything from the overrides
    overrides = [
        f"model.path={model}", f"data.prompt_data={write_prompts(tmp_path / 'prompts.jsonl')}",
        "data.rollout_batch_size=4", "data.n_samples_per_prompt=8", "data.num_rollout=50",
        "rollout.max_response_len=8", "rollout.temperature=1.0", "rollout.reward=toy_rewards:digit_token_fraction",
        "trainer.lr=0.01", "trainer.adam_beta2=0.99", "cluster.device=cpu", "model.dtype=float32",
        "algorithm.routing_replay=rollout",
        f"logging.dir={tmp_path / 'run'}", "logging.tensorboard=false", "logging.progress_bar=false",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SLIME_RL_TORCH_THREADS": "1", "TOY_TOKENIZER": str(model),
           "PYTHONPATH": str(Path(__file__).parents[1] / "support")}
    cli = Path(sys.executable).parent / "slime-cli"
    done = subprocess.run([str(cli), "train", str(config), *overrides], capture_output=True, text=True,
                          timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-5000:]
    metrics = next((tmp_path / "run").rglob("metrics.jsonl"))
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    rewards = [r["rollout/reward_mean"] for r in rows if "rollout/reward_mean" in r]
    assert len(rewards) == 50
    assert sum(rewards[:3]) / 3 < 0.3, rewards[:3]
    assert sum(rewards[-5:]) / 5 >= 0.9, rewards[-10:]
    # replayed experts: on-policy at step 0 the trainer scores the engine's tokens as the engine did
    assert rows[0]["train/train_rollout_logprob_abs_diff"] <= 1e-4
    trained = [r for r in rows if "train/loss" in r]
    assert len(trained) == 50 and all(r["train/moe_expert_load_max_over_mean"] >= 1.0 for r in trained)
    assert all(r["train/moe_routing_replayed"] == 1.0 for r in trained)  # the engine's experts reached the trainer
