"""Sequence parallelism with TP=2 over gloo (our own SP-aware norms, no TransformerEngine) gives what TP=1
gives: log-probs, loss, grad norm and the weights after three steps (fp32, within 1e-5), for an MoE model
(which TP > 1 needs SP for) and dense ones, packed and padded micro-batches of lengths that TP does not
divide; resuming from a checkpoint saved after step 1 replays steps 2..3 bit for bit."""

from __future__ import annotations

import pytest
import torch
from megatron_testlib import assert_replayed_like_one_rank, ensure_single_rank_group, launch, make_hf_model
from megatron_worker import run_scenario

from slime_rl.trainer_megatron import moe, sequence_parallel

# adam_eps 1e-6: Adam's first steps move a weight by about +-lr whatever its gradient's size, so at the default eps
# a gradient of ~1e-9 summed in another order by the TP ranks can flip one weight by 2 lr (CI's qwen3-packed case
# on an AMD EPYC, 2026-12-05); at 1e-6 such a weight moves by lr * g / eps, continuous in g (test_megatron_moe too)
COMMON = ["algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=0.1", "algorithm.entropy_coef=0.01",
          "algorithm.eps_clip=0.1", "trainer.adam_eps=1e-6"]
SP = ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true", "cluster.actor_num_gpus_per_node=2"]


def _tp2_sp_matches_one_rank(family: str, batching: list[str], tmp_path, *, tie: bool = False, **fields) -> dict:
    model = make_hf_model(tmp_path / "model", family, tie=tie, vocab=256, **fields)
    spec = dict(model=str(model), num_samples=6, vocab=256, ref=True, steps=3)
    ensure_single_rank_group()
    single = run_scenario({**spec, "overrides": COMMON + batching})
    multi = launch(2, {**spec, "overrides": COMMON + batching + SP, "save_after": 1, "ckpt": str(tmp_path / "ckpt")},
                   tmp_path)
    assert single["roundtrip_exact"] and multi["roundtrip_exact"] and multi["peers_agree"]
    for a, b in zip(single["log_probs"], multi["log_probs"], strict=True):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    for one, two in zip(single["metrics"], multi["metrics"], strict=True):
        for name in ("loss", "grad_norm", "ref_kl", "entropy", "ppo_kl"):
            assert abs(one[name] - two[name]) <= 1e-5, (name, one, two)
        if "moe_expert_load_max_over_mean" in one:  # the TP ranks' loads summed, TP's padding not counted
            assert abs(one["moe_expert_load_max_over_mean"] - two["moe_expert_load_max_over_mean"]) <= 1e-6
    assert multi["metrics"][2]["ppo_kl"] != 0  # the steps moved the policy
    assert sorted(single["final"]) == sorted(multi["final"])
    for name, t in single["final"].items():
        assert torch.allclose(t, multi["final"][name], atol=1e-5, rtol=0), name
    # resume after step 1: steps 2 and 3 replay bit for bit
    assert multi["resumed_metrics"] == multi["metrics"][1:]
    assert all(torch.equal(t, multi["resumed_final"][n]) for n, t in multi["final"].items())
    return multi


def test_moe_tp2_with_sequence_parallel_matches_one_rank(tmp_path):
    """Qwen3-MoE (qk-norm), packed micro-batches of odd token counts: each padded by a sequence for TP."""
    multi = _tp2_sp_matches_one_rank("qwen3_moe", ["trainer.max_tokens_per_gpu=41"], tmp_path)
    assert multi["local_experts"] == 2 * 8  # ETP=1, EP=1: both TP ranks hold every expert
    assert all(m["moe_expert_load_max_over_mean"] >= 1.0 for m in multi["metrics"])


def test_deepseek_v3_mla_tp2_with_sequence_parallel_matches_one_rank(tmp_path):
    """DeepSeek-V3 (issue 37): multi-head latent attention split by heads (q_b_proj and kv_b_proj column-parallel,
    the down-projections and latent norms replicated with their gradients summed over TP, o_proj row-parallel) with
    GLM-4.5's routing, dense first layer and shared expert; packed micro-batches of odd token counts. The HF round
    trip at TP=2 is bit-exact (kv_b_proj split and merged by heads)."""
    multi = _tp2_sp_matches_one_rank("deepseek_v3", ["trainer.max_tokens_per_gpu=41"], tmp_path)
    assert "model.layers.1.self_attn.kv_b_proj.weight" in multi["exported_names"]


SLOW_CASES = {
    # GLM-4.5 (issue 37): dense first layer, sigmoid routing with the correction bias in 2 groups, shared expert,
    # partial RoPE, attention biases and q/k norms; padded rows (at Adam's default eps one weight of the dense MLP
    # whose gradient is ~1e-9 ended 2e-5 apart: COMMON's eps)
    "glm4_moe-padded": ("glm4_moe", False, ["trainer.micro_batch_size=3"]),
    # DeepSeek-V3 on padded rows (the packed case runs in make test)
    "deepseek_v3-padded": ("deepseek_v3", False, ["trainer.micro_batch_size=3"]),
    # Qwen2-MoE: the shared expert and its gate (tagged sequence_parallel by megatron-core), padded rows
    "qwen2_moe-padded": ("qwen2_moe", False, ["trainer.micro_batch_size=3"]),
    # dense with QKV biases and a tied LM head, padded micro-batches
    "qwen2-padded": ("qwen2", True, ["trainer.micro_batch_size=2"]),
    # dense with qk-norm and an untied head, packed
    "qwen3-packed": ("qwen3", False, ["trainer.max_tokens_per_gpu=41"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(SLOW_CASES))
def test_tp2_with_sequence_parallel_matches_one_rank(case, tmp_path):
    family, tie, batching = SLOW_CASES[case]
    _tp2_sp_matches_one_rank(family, batching, tmp_path, tie=tie)


MLA_CASES = {
    # V2-Lite's q layout (q_lora_rank null): one q_proj, column-parallel by heads on the gathered sequence
    "v2-lite-q": ("deepseek_v3", {"q_lora_rank": None}, "model.layers.0.self_attn.q_proj.weight"),
    # DeepSeek-V2's routing (softmax, group-limited greedy by each group's best expert) on sequence-split tokens
    "deepseek_v2": ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_routed_experts": 16, "n_group": 4,
                                    "topk_group": 2, "num_experts_per_tok": 4}, "model.layers.1.mlp.gate.weight"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(MLA_CASES))
def test_mla_variants_tp2_match_one_rank(case, tmp_path):
    family, fields, name = MLA_CASES[case]
    multi = _tp2_sp_matches_one_rank(family, ["trainer.max_tokens_per_gpu=41"], tmp_path, **fields)
    assert name in multi["exported_names"]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_routing_replay_under_sequence_parallel_matches_one_rank(family, tmp_path):
    """The engine's experts (random ones, which no router would pick) under SP: each TP rank replays its part
    of the sequence, the padding's tokens go to experts 0..k-1; log-probs and steps equal one rank's. DeepSeek-V3:
    a dense first layer (no router), MLA split by heads."""
    model = make_hf_model(tmp_path / "model", family, vocab=256)
    spec = dict(model=str(model), num_samples=6, vocab=256, steps=2, random_routes=True, ref=True)
    overrides = COMMON + ["algorithm.routing_replay=rollout", "trainer.micro_batch_size=2"]
    ensure_single_rank_group()
    single = run_scenario({**spec, "overrides": overrides})
    multi = launch(2, {**spec, "overrides": overrides + SP}, tmp_path)
    assert_replayed_like_one_rank(single, multi)


@pytest.mark.slow
def test_critic_and_pipeline_under_sequence_parallel_match_one_rank(tmp_path):
    """The value head on the gathered hidden states (TP=2 + SP), and TP=2 + SP x PP=2 (the stages pass
    sequence-split activations): values, losses and grad norms equal one rank's."""
    from megatron_worker import run_critic

    model = make_hf_model(tmp_path / "model", "qwen2", vocab=256)
    critic = dict(scenario="critic", model=str(model), num_samples=6, vocab=256, steps=2, prompt=(3, 9),
                  response=(2, 12))
    overrides = ["trainer.critic_lr=0.01", "algorithm.value_clip=100", "trainer.micro_batch_size=2"]
    ensure_single_rank_group()
    single = run_critic({**critic, "overrides": overrides})
    multi = launch(2, {**critic, "overrides": overrides + SP}, tmp_path)
    for one, two in zip(single["values"], multi["values"], strict=True):
        assert all(torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
                   for a, b in zip(one, two, strict=True))
    for one, two in zip(single["metrics"], multi["metrics"], strict=True):
        assert abs(one["loss"] - two["loss"]) <= 1e-5 and abs(one["grad_norm"] - two["grad_norm"]) <= 1e-5

    spec = dict(model=str(model), num_samples=6, vocab=256, steps=2, ref=True)
    batching = COMMON + ["trainer.max_tokens_per_gpu=41"]  # COMMON's adam_eps: four ranks sum in another order
    single = run_scenario({**spec, "overrides": batching})
    four = launch(4, {**spec, "overrides": batching + SP[:2] + ["parallel.pipeline_model_parallel_size=2",
                                                                "cluster.actor_num_gpus_per_node=4"]}, tmp_path)
    for one, two in zip(single["metrics"], four["metrics"], strict=True):
        assert abs(one["loss"] - two["loss"]) <= 1e-5 and abs(one["grad_norm"] - two["grad_norm"]) <= 1e-5
    for name, t in single["final"].items():
        assert torch.allclose(t, four["final"][name], atol=1e-5, rtol=0), name


@pytest.mark.slow
def test_mla_under_sequence_parallel_and_pipeline_matches_one_rank(tmp_path):
    """DeepSeek-V3 at TP=2 + SP x PP=2 on four ranks (the dense layer on the first stage, the MoE layer on the
    second): the HF export gathers MLA's head-split tensors on each stage's TP ranks and broadcasts them over PP,
    bit-exact; log-probs, losses, grad norms and weights equal one rank's over two steps."""
    model = make_hf_model(tmp_path / "model", "deepseek_v3", vocab=256)
    spec = dict(model=str(model), num_samples=6, vocab=256, steps=2, ref=True)
    batching = COMMON + ["trainer.max_tokens_per_gpu=41"]
    ensure_single_rank_group()
    single = run_scenario({**spec, "overrides": batching})
    four = launch(4, {**spec, "overrides": batching + SP[:2] + ["parallel.pipeline_model_parallel_size=2",
                                                                "cluster.actor_num_gpus_per_node=4"]}, tmp_path)
    assert four["roundtrip_exact"] and four["peers_agree"]
    for a, b in zip(single["log_probs"], four["log_probs"], strict=True):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    for one, two in zip(single["metrics"], four["metrics"], strict=True):
        assert abs(one["loss"] - two["loss"]) <= 1e-5 and abs(one["grad_norm"] - two["grad_norm"]) <= 1e-5
    for name, t in single["final"].items():
        assert torch.allclose(t, four["final"][name], atol=1e-5, rtol=0), name


def test_refusals_name_the_fix():
    shape = moe.MoEShape(num_experts=8, topk=2, expert_intermediate_size=32, norm_topk_prob=True,
                         shared_expert_intermediate_size=None)
    with pytest.raises(ValueError, match="parallel.sequence_parallel=true"):
        moe.check_expert_parallel(shape, tp=2, ep=1, etp=1)
    moe.check_expert_parallel(shape, tp=2, ep=1, etp=1, sequence_parallel=True)
    with pytest.raises(ValueError, match="context_parallel_size to 1"):
        sequence_parallel.check_supported(tp=2, cp=2, lora=False)
    with pytest.raises(ValueError, match="trainer.lora"):
        sequence_parallel.check_supported(tp=2, cp=1, lora=True)
    sequence_parallel.check_supported(tp=1, cp=2, lora=True)  # SP asked with TP=1: nothing is split
