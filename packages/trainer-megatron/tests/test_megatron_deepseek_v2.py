"""DeepSeek-V2 and V2-Lite (DeepseekV2ForCausalLM) in the Megatron trainer: DeepSeek-V3's multi-head latent attention
(mla.py) with V2's routing (softmax over the experts, greedy or group-limited greedy top-k, unrenormalised, times the
routed scaling factor; no correction bias). HF -> Megatron -> HF is bit-exact, log-probs equal transformers' (fp32,
<= 1e-4) with and without the q down-projection (V2-Lite's q_lora_rank null) and with group-limited routing, and the
routing's parts move transformers' log-probs by far more than that when changed."""

from __future__ import annotations

import pytest
import torch
from megatron_testlib import (
    load_hf,
    make_samples,
    max_gap_to_hf,
    sample_log_probs,
    to_batch,
    trainer_for,
    wide_model,
)

from slime_rl.trainer_megatron.convert import SafetensorsFolder

VOCAB = 256
# V2's group-limited greedy at a tiny scale: 16 experts in 4 groups, the top-4 of the best 2 groups (V2: 160 in 8,
# top-6 of 3). topk / topk_group = 2, so megatron-core's own rule (a group scores its best 2) would differ from V2's.
GROUP_LIMITED = {"topk_method": "group_limited_greedy", "n_routed_experts": 16, "n_group": 4, "topk_group": 2,
                 "num_experts_per_tok": 4}


def v2_model(path, **fields):
    """A tiny random DeepSeek-V2 folder, its weights drawn wide (megatron_testlib.wide_model)."""
    return wide_model(path, "deepseek_v2", vocab=VOCAB, **fields)


def load_v2_hf(model_dir):
    """transformers' DeepseekV2ForCausalLM (fp32). In 5.12.1 (SGLang 0.5.17's, on the GPU machine) the MoE block's
    group-limited routing reads ``self.num_experts``, which that block never sets (later releases route in a router
    module that does): set it to the config's expert count, so that release can be the reference too."""
    hf = load_hf(model_dir)
    for layer in hf.model.layers:
        if type(layer.mlp).__name__ == "DeepseekV2Moe" and not hasattr(layer.mlp, "num_experts"):
            layer.mlp.num_experts = hf.config.n_routed_experts
    return hf


def _samples():
    return make_samples(5, VOCAB, prompt=(4, 12), response=(4, 20))


CASES = {"v2": {}, "v2-lite": {"q_lora_rank": None}, "group-limited": GROUP_LIMITED}


@pytest.mark.parametrize("case", sorted(CASES))
def test_round_trip_is_bit_exact_and_log_probs_match_transformers(case, tmp_path):
    model_dir = v2_model(tmp_path / "m", **CASES[case])
    trainer = trainer_for(model_dir)
    assert trainer.shape.family == "deepseek_v2" and trainer.shape.mla is not None
    assert (trainer.shape.moe.score_function, trainer.shape.moe.expert_bias, trainer.shape.moe.norm_topk_prob) == (
        "softmax", False, False)
    reader = SafetensorsFolder(model_dir)
    exported = dict(item for bucket in trainer.named_weights(bucket_bytes=64 << 10) for item in bucket)
    assert sorted(exported) == sorted(reader.weight_map)
    assert all(torch.equal(t, reader.get(n)) for n, t in exported.items())
    q = "q_proj" if case == "v2-lite" else "q_a_proj"
    assert f"model.layers.1.self_attn.{q}.weight" in exported and "model.layers.1.mlp.gate.weight" in exported
    samples = _samples()
    assert max_gap_to_hf(samples, sample_log_probs(trainer, samples), load_v2_hf(model_dir)) <= 1e-4


def test_a_trained_v2_saves_every_tensor_under_its_hf_name(tmp_path):
    """Packed micro-batches match transformers too; after a GRPO step save_hf writes the checkpoint's names, the
    router and kv_b_proj trained."""
    model_dir = v2_model(tmp_path / "m")
    trainer = trainer_for(model_dir, ["trainer.max_tokens_per_gpu=64"])
    samples = _samples()
    assert max_gap_to_hf(samples, sample_log_probs(trainer, samples), load_v2_hf(model_dir)) <= 1e-4
    batch = to_batch(samples)
    batch.old_log_probs = trainer.compute_log_probs(batch)
    trainer.train_step(batch)
    trainer.save_hf(str(tmp_path / "out"))
    reader, saved = SafetensorsFolder(model_dir), SafetensorsFolder(tmp_path / "out")
    assert sorted(saved.weight_map) == sorted(reader.weight_map)
    for name in ("model.layers.1.mlp.gate.weight", "model.layers.1.self_attn.kv_b_proj.weight"):
        assert not torch.equal(saved.get(name), reader.get(name)), name


def test_each_routing_part_shows_in_the_log_probs(tmp_path):
    """The routing parts the trainer must reproduce each move transformers' log-probs by more than 1e-3 (ten times
    the parity tolerance): the routed scaling factor, the unrenormalised top-k weights (DeepSeek's own code
    renormalises where norm_topk_prob is true; transformers never does), the group-limited search, and a group
    scored by its best expert (megatron-core's rule, the sum of its best topk / topk_group, moves them too)."""
    from transformers.models.deepseek_v2 import modeling_deepseek_v2

    if not hasattr(modeling_deepseek_v2, "DeepseekV2TopkRouter"):  # the variants below edit that module
        pytest.skip("this transformers (5.12.1, the GPU machine's) routes inside DeepseekV2Moe, with no router module")
    model_dir = v2_model(tmp_path / "m", **GROUP_LIMITED)
    samples = _samples()
    ours = sample_log_probs(trainer_for(model_dir), samples)
    assert max_gap_to_hf(samples, ours, load_hf(model_dir)) <= 1e-4

    def changed(edit) -> torch.nn.Module:
        hf = load_hf(model_dir)
        for layer in hf.model.layers[1:]:  # the MoE layers
            edit(layer.mlp.gate)
        return hf

    def renormalised(gate) -> None:
        forward = gate.forward

        def renormalise(hidden):
            logits, weights, indices = forward(hidden)
            weights = weights / gate.routed_scaling_factor
            return logits, weights / weights.sum(-1, keepdim=True) * gate.routed_scaling_factor, indices

        gate.forward = renormalise

    def groups_by_best_two(gate) -> None:
        def route(hidden):
            logits = torch.nn.functional.linear(hidden.view(-1, gate.hidden_dim).float(), gate.weight.float())
            scores = logits.softmax(-1)
            per_group = gate.num_experts // gate.num_group
            group_scores = scores.view(-1, gate.num_group, per_group).topk(2, dim=-1).values.sum(-1)
            chosen = group_scores.topk(gate.topk_group, dim=-1).indices
            mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
            mask = mask.unsqueeze(-1).expand(-1, -1, per_group).reshape(-1, gate.num_experts)
            weights, indices = scores.masked_fill(~mask, 0.0).topk(gate.top_k, dim=-1, sorted=False)
            return logits, weights * gate.routed_scaling_factor, indices

        gate.forward = route

    variants = {
        "routed_scaling_factor 1": changed(lambda g: setattr(g, "routed_scaling_factor", 1.0)),
        "top-k renormalised": changed(renormalised),
        "greedy over all experts": changed(lambda g: setattr(g, "topk_method", "greedy")),
        "groups scored by their best 2 (megatron-core's rule)": changed(groups_by_best_two),
    }
    for name, variant in variants.items():
        assert max_gap_to_hf(samples, ours, variant) > 1e-3, name


def test_v2_routing_megatron_cannot_match_is_refused(tmp_path):
    from slime_rl.trainer_megatron.model import hf_model_shape

    config = load_hf(v2_model(tmp_path / "m", **GROUP_LIMITED)).config
    shape = hf_model_shape(config)
    assert (shape.moe.num_groups, shape.moe.group_topk, shape.moe.scaling_factor, shape.moe.dense_layers,
            shape.moe.shared_expert_intermediate_size, shape.moe.groups_by_best_expert) == (4, 2, 2.5, (0,), 32, True)
    config.n_group, config.topk_group = 8, 1  # one group of 2 experts cannot give 4
    with pytest.raises(ValueError, match="topk_group=1 groups of 2 experts hold fewer than num_experts_per_tok=4"):
        hf_model_shape(config)
    config.n_group, config.topk_group, config.norm_topk_prob = 4, 2, True
    with pytest.raises(ValueError, match="norm_topk_prob=true with DeepSeek-V2 routing"):
        hf_model_shape(config)
    config.norm_topk_prob, config.topk_method = False, "noaux_tc"
    with pytest.raises(ValueError, match="topk_method='noaux_tc' .* not supported for DeepseekV2ForCausalLM"):
        hf_model_shape(config)


def test_a_megatron_core_that_ignores_the_group_rule_is_refused():
    """Where megatron-core's top-k routing would not call the swapped group_limited_topk (another release), the
    check at install raises instead of routing V2 by megatron-core's rule: its answer on the check's token (group
    1, whose best two sum higher; what 0.16.1 gives unswapped) is refused."""
    from types import SimpleNamespace

    from slime_rl.trainer_megatron.deepseek_v2 import _check_installed

    unswapped = SimpleNamespace(topk_routing_with_score_function=lambda **_: (None, torch.tensor([[0, 0, 1, 1]]).bool()))
    with pytest.raises(RuntimeError, match="did not take the best-expert group rule"):
        _check_installed(unswapped)
