"""TP=2, PP=2 and DP=2 over gloo give what TP=1 gives: log-probs (each rank computing only its
data-parallel shard, put back in step order), GRPO advantages computed on the shards, and loss
and grad norm over three optimizer steps (fp32, within 1e-5). Each multi-rank run also checks
HF -> Megatron -> HF is bit-exact on every rank, and that resuming from a checkpoint saved after
step 1 replays steps 2..3 bit for bit (sharded distributed checkpoint)."""

from __future__ import annotations

import pytest
import torch
from megatron_testlib import ensure_single_rank_group, launch, make_hf_model
from megatron_worker import run_scenario

COMMON = ["algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=0.1", "algorithm.entropy_coef=0.01",
          "algorithm.eps_clip=0.1"]

LAYOUTS = {
    # name: (family, tied embeddings, parallel overrides, batching overrides)
    # TP: QKV biases and the vocab-parallel embedding doubling as the LM head
    "tp2": ("qwen2", True, ["parallel.tensor_model_parallel_size=2"], ["trainer.micro_batch_size=2"]),
    # PP: 1F1B over packed micro-batches of different lengths, tied embeddings on two stages
    "pp2": ("llama", True, ["parallel.pipeline_model_parallel_size=2"], ["trainer.max_tokens_per_gpu=40"]),
    # DP: gradients summed (not averaged) over ranks, qk-norm, an untied LM head
    "dp2": ("qwen3", False, [], ["trainer.max_tokens_per_gpu=48"]),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_two_ranks_match_one(layout, tmp_path):
    family, tie, parallel, batching = LAYOUTS[layout]
    model = make_hf_model(tmp_path / "model", family, tie=tie, vocab=256)
    spec = dict(model=str(model), num_samples=6, vocab=256, ref=True, steps=3)
    ensure_single_rank_group()
    single = run_scenario({**spec, "overrides": COMMON + batching})
    multi = launch(2, {**spec, "overrides": COMMON + batching + parallel + ["cluster.actor_num_gpus_per_node=2"],
                       "save_after": 1, "ckpt": str(tmp_path / "ckpt")}, tmp_path)

    assert single["roundtrip_exact"] and multi["roundtrip_exact"]
    assert multi["peers_agree"]  # the ranks of one shard (TP/PP peers) hold the same log-probs
    dp = 2 if layout == "dp2" else 1
    assert single["dp_sum"] == {"sum": [1.0, 0.5], "dtype": "torch.float64", "input": [1.0, 0.5]}
    assert multi["dp_sum"] == {"sum": [dp * (dp + 1) / 2, 0.5 * dp], "dtype": "torch.float64", "input": [1.0, 0.5]}
    flat = [torch.tensor([x for row in run["advantages"] for x in row]) for run in (single, multi)]
    assert flat[0].abs().max() > 0 and torch.allclose(flat[0], flat[1], atol=1e-6, rtol=0)
    for a, b in zip(single["log_probs"], multi["log_probs"], strict=True):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    assert len(multi["metrics"]) == 3
    for one, two in zip(single["metrics"], multi["metrics"], strict=True):
        assert abs(one["loss"] - two["loss"]) <= 1e-5, (one, two)
        assert abs(one["grad_norm"] - two["grad_norm"]) <= 1e-5, (one, two)
        assert abs(one["ref_kl"] - two["ref_kl"]) <= 1e-5
        assert abs(one["entropy"] - two["entropy"]) <= 1e-5
    # the steps really moved the policy (step 3 sees a ratio != 1), the same way in both layouts
    assert multi["metrics"][2]["ppo_kl"] != 0
    assert abs(single["metrics"][2]["ppo_kl"] - multi["metrics"][2]["ppo_kl"]) <= 1e-5

    # resume after step 1: steps 2 and 3 replay bit for bit
    assert multi["resumed_metrics"] == multi["metrics"][1:]
    assert all(torch.equal(t, multi["resumed_final"][n]) for n, t in multi["final"].items())


@pytest.mark.slow
def test_tp2_pp2_on_four_ranks_matches_one(tmp_path):
    model = make_hf_model(tmp_path / "model", "qwen2", tie=True, vocab=256)
    spec = dict(model=str(model), num_samples=8, vocab=256, ref=True, steps=3)
    overrides = COMMON + ["trainer.max_tokens_per_gpu=40"]
    ensure_single_rank_group()
    single = run_scenario({**spec, "overrides": overrides})
    multi = launch(4, {**spec, "overrides": overrides + ["parallel.tensor_model_parallel_size=2",
                                                        "parallel.pipeline_model_parallel_size=2",
                                                        "cluster.actor_num_gpus_per_node=4"],
                       "save_after": 1, "ckpt": str(tmp_path / "ckpt")}, tmp_path)
    assert multi["roundtrip_exact"] and multi["peers_agree"]
    for one, four in zip(single["metrics"], multi["metrics"], strict=True):
        assert abs(one["loss"] - four["loss"]) <= 1e-5 and abs(one["grad_norm"] - four["grad_norm"]) <= 1e-5
    assert multi["resumed_metrics"] == multi["metrics"][1:]
