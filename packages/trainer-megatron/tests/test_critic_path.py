"""model.critic_path: PPO's critic starts from another HF folder than the policy: its trunk from there, and its
value head from the folder's one-label ``score.weight`` when it has one (else the zero head)."""

from __future__ import annotations

import json
import shutil

import torch
from megatron_testlib import ensure_single_rank_group, make_config, make_hf_model, make_samples, to_batch
from safetensors.torch import load_file, save_file

from slime_rl.trainer_megatron.trainer import MegatronTrainer

VOCAB = 256


def critic_from(policy, critic_path):
    ensure_single_rank_group()
    cfg = make_config(policy, [f"model.critic_path={critic_path}"])
    return MegatronTrainer.from_config(cfg, role="critic")


def test_the_critic_starts_from_its_own_folder_and_head(tmp_path):
    policy = make_hf_model(tmp_path / "policy", "qwen2", tie=True, vocab=VOCAB)
    other = make_hf_model(tmp_path / "other", "qwen2", tie=True, vocab=VOCAB, seed=7)
    critic_dir = tmp_path / "critic"
    shutil.copytree(other, critic_dir)
    weights = load_file(critic_dir / "model.safetensors")
    hidden = json.loads((critic_dir / "config.json").read_text())["hidden_size"]
    weights["score.weight"] = torch.full((1, hidden), 0.01, dtype=next(iter(weights.values())).dtype)
    save_file(weights, critic_dir / "model.safetensors", metadata={"format": "pt"})

    critic = critic_from(policy, critic_dir)
    assert torch.equal(critic.model.value_head.weight.detach().float(), torch.full((1, hidden), 0.01))
    embedding = critic.model.embedding.word_embeddings.weight.detach().float()
    assert torch.equal(embedding, weights["model.embed_tokens.weight"].float())  # the other model's trunk
    assert not torch.equal(embedding, load_file(policy / "model.safetensors")["model.embed_tokens.weight"].float())
    batch = to_batch(make_samples(4, VOCAB))
    assert (critic.compute_values(batch) != 0).any()  # a head of its own: values from the first step
