"""Mixture-of-experts models (Qwen3-MoE; Qwen2-MoE with its gated shared expert) on megatron-core's MoE
layer: HF -> Megatron -> HF is bit-exact, log-probs equal transformers' (fp32, <= 1e-4), expert
parallelism over gloo (EP=2) gives EP=1's log-probs, losses, gradient norms and updated weights
(<= 1e-5 over three steps), and routing replay makes the forward use the experts it is given."""

from __future__ import annotations

import pytest
import torch
from megatron_testlib import (
    ensure_single_rank_group,
    hf_response_log_probs,
    launch,
    load_hf,
    make_config,
    make_hf_model,
    make_samples,
    per_sample,
    to_batch,
)
from megatron_worker import run_scenario

from slime_rl.trainer_megatron.convert import SafetensorsFolder
from slime_rl.trainer_megatron.trainer import MegatronTrainer

VOCAB = 256
COMMON = ["algorithm.entropy_coef=0.01", "algorithm.eps_clip=0.1"]


def trainer_for(model_dir, overrides=()):
    ensure_single_rank_group()
    return MegatronTrainer.from_config(make_config(model_dir, list(overrides)))


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_round_trip_and_log_probs_match_transformers(family, tmp_path):
    model_dir = make_hf_model(tmp_path / "m", family, vocab=VOCAB)
    trainer = trainer_for(model_dir)
    reader = SafetensorsFolder(model_dir)
    buckets = list(trainer.named_weights(bucket_bytes=64 << 10))
    exported = dict(item for bucket in buckets for item in bucket)
    assert sorted(exported) == sorted(reader.weight_map)
    assert any(".mlp.experts.7.down_proj.weight" in n for n in exported) and any(".mlp.gate.weight" in n
                                                                                 for n in exported)
    assert all(torch.equal(t, reader.get(n)) for n, t in exported.items())
    assert all(sum(t.numel() * t.element_size() for _, t in b) <= 64 << 10 for b in buckets)

    samples = make_samples(5, VOCAB, prompt=(1, 12), response=(1, 20))
    batch = to_batch(samples)
    ours = per_sample(batch, trainer.compute_log_probs(batch))
    hf = load_hf(model_dir)
    diffs = [(torch.tensor(lp) - hf_response_log_probs(hf, s.tokens, s.response_length)).abs().max()
             for s, lp in zip(samples, ours, strict=True)]
    assert max(float(d) for d in diffs) <= 1e-4
    metrics = trainer.train_step(_with_old(batch, trainer))
    assert metrics["moe_expert_load_max_over_mean"] >= 1.0


def _with_old(batch, trainer):
    batch.old_log_probs = trainer.compute_log_probs(batch)
    return batch


@pytest.mark.parametrize("family,batching", [("qwen2_moe", ["trainer.max_tokens_per_gpu=40"]),
                                             ("qwen3_moe", ["trainer.micro_batch_size=2"])])
def test_expert_parallel_matches_one_rank(family, batching, tmp_path):
    model = make_hf_model(tmp_path / "model", family, vocab=VOCAB)
    spec = dict(model=str(model), num_samples=6, vocab=VOCAB, steps=3)
    ensure_single_rank_group()
    single = run_scenario({**spec, "overrides": COMMON + batching})
    multi = launch(2, {**spec, "overrides": COMMON + batching + ["parallel.expert_model_parallel_size=2",
                                                                "cluster.actor_num_gpus_per_node=2"]}, tmp_path)
    assert single["roundtrip_exact"] and multi["roundtrip_exact"]
    assert (single["local_experts"], multi["local_experts"]) == (2 * 8, 2 * 4)  # 2 layers; EP=2 holds half
    for a, b in zip(single["log_probs"], multi["log_probs"], strict=True):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    for one, two in zip(single["metrics"], multi["metrics"], strict=True):
        assert abs(one["loss"] - two["loss"]) <= 1e-5, (one, two)
        assert abs(one["grad_norm"] - two["grad_norm"]) <= 1e-5, (one, two)
    assert multi["metrics"][2]["ppo_kl"] != 0  # the steps moved the policy
    for name, t in single["final"].items():
        assert torch.allclose(t, multi["final"][name], atol=1e-5, rtol=0), name
