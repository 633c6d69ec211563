"""GPU acceptance of issue 41 (scripts/gpu/run.sh stage vlm-e2e): the CPU acceptance's shapes task
(tests/e2e/test_e2e_vlm.py) through real SGLang 0.5.17 and the Megatron trainer on one GPU, colocated, bf16:
the tiny Qwen2.5-VL learns the colour's number to a held-out accuracy of at least twice chance, and the
log-prob gap between SGLang and the trainer is printed for every step.

    python -m pytest tests/e2e/test_gpu_vlm_e2e.py -m gpu -s
"""

from __future__ import annotations

import pytest
import torch
from test_gpu_e2e import ENGINE_ARGS, train_through_slime_cli

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

STEPS = 150


def test_the_shapes_task_through_sglang_and_megatron(tmp_path):
    from slime_rl.core.testing import tiny_vl_model_folder
    from slime_rl.core.testing.shapes import write_shapes_data

    model = tiny_vl_model_folder(tmp_path / "tiny-vl", dtype=torch.bfloat16)
    train = write_shapes_data(tmp_path / "data", n=512, seed=1, task="colour_number", name="train")
    heldout = write_shapes_data(tmp_path / "data", n=128, seed=2, task="colour_number", name="heldout", strict=True)
    config = {
        "model": {"path": str(model)},
        "data": {"prompt_data": str(train), "image_key": "images", "apply_chat_template": True,
                 "rollout_batch_size": 16, "n_samples_per_prompt": 16, "num_rollout": STEPS},
        "eval": {"prompt_data": {"heldout": str(heldout)}, "interval": 50},
        "rollout": {"engine": "sglang", "sglang": {"server_args": ENGINE_ARGS, "check_weight_update": True},
                    "max_response_len": 1, "reward": "slime_rl.core.testing.shapes:digit_reward_shaped"},
        "trainer": {"backend": "megatron", "lr": 3e-3},
        "cluster": {"device": "cuda", "colocate": True, "actor_num_gpus_per_node": 1},
        "logging": {"dir": str(tmp_path / "run"), "tensorboard": False, "progress_bar": False},
    }
    rows = train_through_slime_cli(config, tokenizer=model, work=tmp_path, timeout=560)
    trained = [r for r in rows if "train/train_rollout_logprob_abs_diff" in r]
    print("[vlm] |SGLang - Megatron| log-prob per step:",
          " ".join(f"{r['train/train_rollout_logprob_abs_diff']:.4f}" for r in trained))
    print("[vlm] reward per step:", " ".join(f"{r['rollout/reward_mean']:.2f}" for r in rows if "rollout/reward_mean" in r))
    accuracy = [r["eval/heldout/reward_mean"] for r in rows if "eval/heldout/reward_mean" in r]
    print("[vlm] held-out accuracy at steps 0/50/100/150:", accuracy, "failed samples:",
          sum(r.get("rollout/samples_failed", 0) for r in rows))
    assert len(trained) == STEPS
    assert accuracy[-1] >= 0.5, accuracy
