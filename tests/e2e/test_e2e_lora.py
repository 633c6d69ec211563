"""LoRA through the real loop on CPU (Ray actors, the Megatron trainer, the HF engine; fp32, a tiny
model): every weight sync sends only the adapters and the engine merges them onto its base, so each
rollout is on-policy (the trainer scores the engine's tokens as the engine did), with the adapter
sync and with the merged sync; a checkpoint with checkpoint.save_hf holds a PEFT folder and the
merged model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_e2e_grpo import write_prompts

from slime_rl.core.config import load_config
from slime_rl.core.run.loop import train


@pytest.mark.parametrize("lora_sync", ["adapter", "merged"])
def test_lora_syncs_keep_the_engine_on_policy(lora_sync, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TOY_TOKENIZER", str(tiny_model_dir))
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[1] / "support"))  # Ray workers import toy_rewards
    monkeypatch.setenv("SLIME_RL_TORCH_THREADS", "1")
    cfg = load_config(None, [
        f"model.path={tiny_model_dir}", f"data.prompt_data={write_prompts(tmp_path / 'prompts.jsonl')}",
        "data.rollout_batch_size=4", "data.n_samples_per_prompt=4", "data.num_rollout=4",
        "rollout.max_response_len=8", "rollout.reward=toy_rewards:digit_token_fraction", "model.dtype=float32",
        "trainer.lora.rank=8", "trainer.lora.alpha=16", "trainer.lr=0.05", f"rollout.lora_sync={lora_sync}",
        "algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=0.1",
        "cluster.device=cpu", f"logging.dir={tmp_path / 'run'}", "logging.tensorboard=false",
        f"checkpoint.save_dir={tmp_path / 'ckpt'}", "checkpoint.save_hf=true", "checkpoint.save_hf_merged=true",
    ])
    summary = train(cfg)
    rows = [json.loads(line) for line in Path(summary["metrics_file"]).read_text().splitlines()]
    train_rows = [r for r in rows if "train/train_rollout_logprob_abs_diff" in r]
    assert len(train_rows) == 4
    # the policy moved (the KL to the base grows) and the engine followed it at every step
    kl = [r["train/ref_kl"] for r in train_rows]
    assert kl[0] == 0 and kl[-1] > 1e-4, kl
    assert all(r["train/train_rollout_logprob_abs_diff"] <= 1e-4 for r in train_rows), train_rows
    hf = tmp_path / "ckpt" / "step_000004" / "hf"
    assert json.loads((hf / "adapter_config.json").read_text())["r"] == 8
    assert (hf / "adapter_model.safetensors").is_file() and (hf / "merged" / "model.safetensors").is_file()
