"""GroupedExperts (all local experts in one torch._grouped_mm per projection) against Megatron's
SequentialMLP (one GEMM per expert), fp32 on the CPU: the module's outputs and every gradient, on
the grouped path and on its per-expert fallback; the whole trainer's log-probs, losses, gradient
norms and updated weights over three steps; checkpoints read across the two; the layer spec of
both megatron-core spec forms. (EP=2 and EP=2 x ETP=2 against SequentialMLP on one rank:
test_megatron_moe.py.)"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from megatron_testlib import ensure_single_rank_group, make_config, make_hf_model
from megatron_worker import run_scenario

from slime_rl.trainer_megatron import grouped_experts
from slime_rl.trainer_megatron.grouped_experts import GroupedExperts
from slime_rl.trainer_megatron.trainer import MegatronTrainer

VOCAB = 256
COMMON = ["algorithm.entropy_coef=0.01", "algorithm.eps_clip=0.1", "trainer.micro_batch_size=3"]


def _experts_pair(model_dir):
    """A SequentialMLP and a GroupedExperts holding the same random weights (8 experts, hidden 64,
    ffn 32), built with a trainer's MoE config and process groups."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from slime_rl.trainer_megatron.model import transformer_config
    from slime_rl.trainer_megatron.moe import transformer_config_fields

    ensure_single_rank_group()
    shape = MegatronTrainer.from_config(make_config(model_dir)).shape  # Megatron's process groups exist now
    moe_fields = transformer_config_fields(shape.moe, ep=1, etp=1, aux_loss_coeff=0.0, z_loss_coeff=None,
                                           load_balancing_type="aux_loss", routing_replay=False)
    config = transformer_config(shape, tp=1, pp=1, dtype=torch.float32, moe_fields=moe_fields)
    groups = get_default_pg_collection()
    sequential = SequentialMLP(8, config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                               pg_collection=groups)
    grouped = GroupedExperts(8, config, pg_collection=groups)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for e, expert in enumerate(sequential.local_experts):
            expert.linear_fc1.weight.copy_(torch.randn(expert.linear_fc1.weight.shape, generator=g) / 8)
            expert.linear_fc2.weight.copy_(torch.randn(expert.linear_fc2.weight.shape, generator=g) / 8)
            grouped.fc1_weight[e].copy_(expert.linear_fc1.weight)
            grouped.fc2_weight[e].copy_(expert.linear_fc2.weight)
    return sequential, grouped


def _run(module, tokens, counts, probs, grad_out):
    """Outputs and the gradients of tokens, routing weights and every weight (stacked per expert)."""
    tokens, probs = tokens.clone().requires_grad_(), probs.clone().requires_grad_()
    out, bias = module(tokens, counts, probs)
    assert bias is None
    out.backward(grad_out)
    if isinstance(module, GroupedExperts):
        weights = [module.fc1_weight.grad, module.fc2_weight.grad]
    else:
        weights = [torch.stack([e.linear_fc1.weight.grad for e in module.local_experts]),
                   torch.stack([e.linear_fc2.weight.grad for e in module.local_experts])]
    module.zero_grad()
    return [out.detach(), tokens.grad, probs.grad, *weights]


@pytest.mark.parametrize("path", ["grouped_mm", "per_expert"])
def test_experts_match_sequential_mlp(path, tmp_path, monkeypatch):
    sequential, grouped = _experts_pair(make_hf_model(tmp_path / "m", "qwen3_moe", vocab=VOCAB))
    assert grouped_experts._grouped_mm_works("cpu", torch.float32)  # this torch runs it on the CPU
    if path == "per_expert":
        monkeypatch.setattr(grouped_experts, "_grouped_mm_fits", lambda *tensors: False)
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = torch.Generator().manual_seed(4)
    counts = torch.tensor([3, 0, 5, 1, 0, 7, 2, 4])  # empty experts among full ones
    tokens = torch.randn(int(counts.sum()), 64, generator=g)
    probs, grad_out = torch.rand(tokens.shape[0], generator=g), torch.randn(tokens.shape[0], 64, generator=g)
    ours, theirs = _run(grouped, tokens, counts, probs, grad_out), _run(sequential, tokens, counts, probs, grad_out)
    for name, a, b in zip(["output", "tokens", "probs", "fc1", "fc2"], ours, theirs, strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5), (name, (a - b).abs().max())
    assert ours[4][1].abs().sum() == 0 and ours[4][0].abs().sum() > 0  # no token, no gradient
    assert len(calls) == (2 if path == "grouped_mm" else 0)  # fc1 and fc2, forward
    # No token reached this rank's experts: an empty output, and zero (not missing) weight gradients.
    empty = _run(grouped, tokens[:0], torch.zeros(8, dtype=torch.long), probs[:0], grad_out[:0])
    assert empty[0].shape == (0, 64) and empty[3].abs().sum() == 0 and empty[4].abs().sum() == 0


def test_miscounted_tokens_are_refused(tmp_path):
    _, grouped = _experts_pair(make_hf_model(tmp_path / "m", "qwen3_moe", vocab=VOCAB))
    with pytest.raises(ValueError, match="GroupedExperts: 5 tokens counted for 6 dispatched"):
        grouped(torch.zeros(6, 64), torch.tensor([5, 0, 0, 0, 0, 0, 0, 0]), torch.ones(6))


def test_unaligned_rows_take_the_per_expert_loop():
    """Rows that are not a multiple of 16 bytes (here 12 fp32 values = 48 bytes is fine, 6 is not)."""
    aligned, odd = torch.zeros(4, 12), torch.zeros(4, 6)
    stacked = torch.zeros(2, 8, 12)
    assert grouped_experts._grouped_mm_fits(aligned, stacked)
    assert not grouped_experts._grouped_mm_fits(odd, stacked)
    assert not grouped_experts._grouped_mm_fits(aligned[:0], stacked)  # no token


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_trainer_with_grouped_experts_matches_sequential(family, tmp_path):
    """Log-probs, then three GRPO steps: losses, gradient norms and every updated weight (HF names)."""
    model = make_hf_model(tmp_path / "model", family, vocab=VOCAB)
    spec = dict(model=str(model), num_samples=6, vocab=VOCAB, steps=3)
    ensure_single_rank_group()
    sequential = run_scenario({**spec, "overrides": COMMON + ["trainer.megatron.moe_grouped_gemm=false"]})
    grouped = run_scenario({**spec, "overrides": COMMON})
    assert (sequential["experts_modules"], grouped["experts_modules"]) == (["SequentialMLP"], ["GroupedExperts"])
    assert grouped["roundtrip_exact"] and grouped["exported_names"] == sequential["exported_names"]
    for a, b in zip(sequential["log_probs"], grouped["log_probs"], strict=True):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    for one, two in zip(sequential["metrics"], grouped["metrics"], strict=True):
        assert abs(one["loss"] - two["loss"]) <= 1e-5 and abs(one["grad_norm"] - two["grad_norm"]) <= 1e-5
    assert grouped["metrics"][2]["ppo_kl"] != 0  # the steps moved the policy
    for name, t in sequential["final"].items():
        assert torch.allclose(t, grouped["final"][name], atol=1e-5, rtol=0), name


def test_checkpoints_read_across_sequential_and_grouped(tmp_path):
    """A SequentialMLP trainer's checkpoint (model, optimizer) resumes a grouped one and back: same
    sharded keys and global expert layout."""
    model = make_hf_model(tmp_path / "model", "qwen2_moe", vocab=VOCAB)
    ensure_single_rank_group()
    from megatron_testlib import make_samples, to_batch

    batch = to_batch(make_samples(4, VOCAB))
    trainers = {grouped: MegatronTrainer.from_config(make_config(model, COMMON + [f"trainer.megatron.moe_grouped_gemm={grouped}"]))
                for grouped in (False, True)}
    for source, target in ((False, True), (True, False)):
        batch.old_log_probs = trainers[source].compute_log_probs(batch)
        trainers[source].train_step(batch)  # weights and Adam moments away from the HF folder's
        trainers[source].save(str(tmp_path / f"ckpt-{source}"))
        trainers[target].load(str(tmp_path / f"ckpt-{source}"))
        weights = [dict(item for b in trainers[s].named_weights(1 << 20) for item in b) for s in (source, target)]
        assert all(torch.equal(t, weights[1][n]) for n, t in weights[0].items())
        a, b = (trainers[s].train_step(batch) for s in (source, target))  # the optimizer state came along
        assert abs(a["loss"] - b["loss"]) <= 1e-6 and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5


def test_layer_spec_takes_grouped_experts_in_both_megatron_spec_forms():
    """megatron-core 0.16 gives the MoE layer as a ModuleSpec, 0.19 as a functools.partial of MoELayer."""
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    from slime_rl.trainer_megatron.model import _with_experts

    submodules = MoESubmodules(experts="sequential", shared_experts="shared")
    as_spec = _with_experts(ModuleSpec(module=MoELayer, submodules=submodules), GroupedExperts)
    as_partial = _with_experts(functools.partial(MoELayer, submodules=submodules), GroupedExperts)
    assert as_spec.module is MoELayer and as_partial.func is MoELayer
    for moe in (as_spec.submodules, as_partial.keywords["submodules"]):
        assert moe == dataclasses.replace(submodules, experts=GroupedExperts)
    assert submodules.experts == "sequential"  # the original spec is left as it was
