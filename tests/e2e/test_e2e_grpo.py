"""End to end on CPU: real Ray actors, the real Megatron trainer (TP=1 and TP=2 over gloo) and the
transformers rollout engine learn a toy reward with GRPO through `slime_rl.core.run.loop.train`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slime_rl.core.config import load_config
from slime_rl.core.run.loop import train

PROMPTS = ["def main(", "import os\n", "class Foo:", "for i in range(", "return self.", "x = [", "if __name__",
           "print(", "while True:", "with open("]


def write_prompts(path: Path) -> Path:
    path.write_text("".join(json.dumps({"input": p, "label": ""}) + "\n" for p in PROMPTS * 20))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("tp,one_step_off", [(1, False), (2, False), (1, True)],
                         ids=["tp1-sync", "tp2-sync", "tp1-async-disaggregated"])
def test_grpo_learns_toy_reward(tp, one_step_off, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TOY_TOKENIZER", str(tiny_model_dir))
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[1] / "support"))  # Ray workers import toy_rewards
    monkeypatch.setenv("SLIME_RL_TORCH_THREADS", "1")
    cfg = load_config(None, [
        f"model.path={tiny_model_dir}",
        f"data.prompt_data={write_prompts(tmp_path / 'prompts.jsonl')}",
        "data.rollout_batch_size=4", "data.n_samples_per_prompt=8", "data.num_rollout=60",
        "rollout.max_response_len=8", "rollout.temperature=1.0", "rollout.reward=toy_rewards:digit_token_fraction",
        "trainer.lr=0.01", "trainer.adam_beta2=0.99", "cluster.device=cpu",
        "model.dtype=float32",  # the step-0 log-prob gap below is fp32's; auto may pick bf16 on this CPU
        f"cluster.actor_num_gpus_per_node={tp}", f"parallel.tensor_model_parallel_size={tp}",
        f"logging.dir={tmp_path / 'run'}", "logging.tensorboard=false",
        f"cluster.async_mode={'one_step' if one_step_off else 'off'}", f"cluster.colocate={not one_step_off}",
    ])
    summary = train(cfg)
    rows = [json.loads(line) for line in Path(summary["metrics_file"]).read_text().splitlines()]
    rewards = [r["rollout/reward_mean"] for r in rows if "rollout/reward_mean" in r]
    assert len(rewards) == 60
    assert sum(rewards[:3]) / 3 < 0.3, rewards[:3]
    assert sum(rewards[-5:]) / 5 >= 0.9, rewards[-10:]
    # on-policy at step 0: the trainer scores the engine's tokens as the engine did
    assert rows[0]["train/train_rollout_logprob_abs_diff"] <= 1e-4
    lags = [r["rollout/weight_version_lag"] for r in rows if "rollout/weight_version_lag" in r]
    # one step off: rollout k+1 overlapped training on k, so it ran on weights one version old
    assert lags == [0.0] + [1.0 if one_step_off else 0.0] * 59
