"""DeepSeek-V2 / V2-Lite (``DeepseekV2ForCausalLM``) routing on megatron-core's router; the attention is DeepSeek-V3's
multi-head latent attention (mla.py), the dense first layers and shared experts are DeepSeek-V3's (moe.py).

As transformers' ``DeepseekV2TopkRouter`` routes: softmax over all experts' logits, the top-k of those probabilities
as they are (never renormalised) times ``routed_scaling_factor`` (megatron-core's pre-softmax top-k with its
scaling factor); no correction bias. ``greedy`` searches every expert (V2-Lite); ``group_limited_greedy`` (V2) only
the experts of the ``topk_group`` of ``n_group`` groups whose best expert scores highest. megatron-core scores a
group by the sum of its best ``topk / topk_group`` experts instead (DeepSeek-V3's rule, 2 of 6 / 3 for V2), so the
routers of a V2 model score groups by their best expert (`score_groups_by_best_expert`).
"""

from __future__ import annotations

import contextvars
import functools

import torch

from slime_rl.trainer_megatron.moe import MoEShape, check_groups, deepseek_layers

# True while one of a V2 model's routers runs: megatron-core's group-limited top-k then scores groups as V2 does
_BEST_EXPERT_GROUPS = contextvars.ContextVar("slime_rl_best_expert_groups", default=False)


def deepseek_v2_moe_shape(hf_config) -> MoEShape:
    """DeepSeek-V2's MoE fields, refusing what the trainer would route differently from transformers."""
    experts, topk = hf_config.n_routed_experts, hf_config.num_experts_per_tok
    method, scoring = getattr(hf_config, "topk_method", None) or "greedy", getattr(hf_config, "scoring_func", None)
    if method not in ("greedy", "group_limited_greedy") or (scoring or "softmax") != "softmax":
        raise ValueError(f"model.path: topk_method={method!r} with scoring_func={scoring!r} is not supported for"
                         " DeepseekV2ForCausalLM; its routing is softmax with greedy or group_limited_greedy")
    if getattr(hf_config, "norm_topk_prob", False):
        # transformers' V2 router never renormalises; DeepSeek's own code and SGLang do where this is true
        raise ValueError("model.path: norm_topk_prob=true with DeepSeek-V2 routing is not supported (transformers"
                         " ignores it, DeepSeek's code and SGLang renormalise the top-k)")
    groups = (getattr(hf_config, "n_group", None) or 1) if method == "group_limited_greedy" else 1
    group_topk = (getattr(hf_config, "topk_group", None) or 1) if groups > 1 else 1
    check_groups(experts, groups, group_topk)
    if groups > 1 and group_topk * (experts // groups) < topk:
        raise ValueError(f"model.path: topk_group={group_topk} groups of {experts // groups} experts hold fewer than"
                         f" num_experts_per_tok={topk}")
    if (getattr(hf_config, "moe_layer_freq", 1) or 1) != 1:
        raise ValueError(f"model.path: moe_layer_freq={hf_config.moe_layer_freq} is not supported (transformers"
                         " makes every layer after first_k_dense_replace an MoE layer)")
    dense, shared, scaling = deepseek_layers(hf_config)
    return MoEShape(
        num_experts=experts,
        topk=topk,
        expert_intermediate_size=hf_config.moe_intermediate_size,
        norm_topk_prob=False,  # softmax over all experts, then the top-k as they are (pre-softmax top-k)
        shared_expert_intermediate_size=shared or None,
        hf_shared_experts="shared_experts",
        num_groups=groups if groups > 1 else None,
        group_topk=group_topk if groups > 1 else None,
        scaling_factor=scaling if scaling != 1.0 else None,
        dense_layers=tuple(range(dense)),
        groups_by_best_expert=groups > 1,
    )


def score_groups_by_best_expert(model: torch.nn.Module) -> None:
    """Every router of ``model`` scores an expert group by its best expert while it runs (V2's group-limited
    greedy), through megatron-core's ``group_limited_topk``; other models' routers keep megatron-core's rule."""
    from megatron.core.transformer.moe.router import TopKRouter

    _install()
    for module in model.modules():
        if isinstance(module, TopKRouter) and not getattr(module, "_slime_best_expert_groups", False):
            module.forward = _with_best_expert_groups(module.forward)
            module._slime_best_expert_groups = True


def _with_best_expert_groups(forward):
    @functools.wraps(forward)
    def routed(*args, **kwargs):
        token = _BEST_EXPERT_GROUPS.set(True)
        try:
            return forward(*args, **kwargs)
        finally:
            _BEST_EXPERT_GROUPS.reset(token)

    return routed


@functools.cache
def _install() -> None:
    """megatron-core's ``group_limited_topk`` (looked up by name where its top-k routing calls it), scoring groups
    by their best expert inside a V2 router's forward."""
    from megatron.core.transformer.moe import moe_utils

    megatron_rule = moe_utils.group_limited_topk

    def group_limited_topk(scores: torch.Tensor, topk: int, num_tokens: int, num_experts: int, num_groups: int,
                           group_topk: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not _BEST_EXPERT_GROUPS.get():
            return megatron_rule(scores, topk, num_tokens, num_experts, num_groups, group_topk)
        group_scores = scores.view(num_tokens, num_groups, -1).max(dim=-1).values
        chosen = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
        expert_mask = group_mask.unsqueeze(-1).expand(num_tokens, num_groups, num_experts // num_groups)
        masked = scores.masked_fill(~expert_mask.reshape(num_tokens, -1), float("-inf"))
        return torch.topk(masked, k=topk, dim=-1)

    moe_utils.group_limited_topk = group_limited_topk
    _check_installed(moe_utils)


def _check_installed(moe_utils) -> None:
    """The rule must reach megatron-core's top-k routing (a release that looked ``group_limited_topk`` up elsewhere
    would route V2 by megatron-core's rule, silently): one token whose best expert is in group 0 (0.4 against 0.3)
    while group 1's best two sum higher (0.6 against 0.42) must go to group 0's experts."""
    logits = torch.tensor([[0.40, 0.02, 0.30, 0.28]]).log()
    token = _BEST_EXPERT_GROUPS.set(True)
    try:
        _, routing_map = moe_utils.topk_routing_with_score_function(logits=logits, topk=2, use_pre_softmax=True,
                                                                    num_groups=2, group_topk=1)
    finally:
        _BEST_EXPERT_GROUPS.reset(token)
    if routing_map[0].tolist() != [True, True, False, False]:
        raise RuntimeError("DeepSeek-V2 group-limited routing: megatron-core's top-k routing did not take the"
                           " best-expert group rule (deepseek_v2.py); this megatron-core release routes V2 otherwise")
