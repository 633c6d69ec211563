"""Mixture-of-experts pieces of the Megatron trainer: Qwen3-MoE, Qwen2-MoE, GLM-4.5-style MoE and DeepSeek-V3 on
megatron-core's MoE layer (local spec, no TransformerEngine).

Routing, as each family's HF model defines it (moe_utils.topk_routing_with_score_function in megatron-core):
- Qwen3-MoE / Qwen2-MoE: softmax over the router logits, top-k, Qwen3 renormalises the top-k.
- GLM-4.5 (and DeepSeek-V3, which routes the same way: "noaux_tc"): sigmoid scores; the experts are
  chosen by score + ``e_score_correction_bias`` (megatron's ``expert_bias``), first among the
  ``topk_group`` best of ``n_group`` groups (a group scores the sum of its 2 best biased scores), and
  weighted by their unbiased scores, renormalised, times ``routed_scaling_factor``. The bias is frozen
  in training (``moe_router_bias_update_rate=0``): it is loaded from and saved to the checkpoint as it is,
  and never updated from the expert loads (DeepSeek's auxiliary-loss-free balancing is not run).
- DeepSeek-V2 / V2-Lite (deepseek_v2.py): softmax over all experts, top-k of those probabilities unrenormalised
  times ``routed_scaling_factor``; group-limited greedy scores a group by its best expert. No correction bias.

Experts run as ``GroupedExperts`` (grouped_experts.py: all local experts in one ``torch._grouped_mm``
per projection), or with ``trainer.megatron.moe_grouped_gemm: false`` as megatron's SequentialMLP (one MLP
per local expert): megatron's own grouped-GEMM experts need TransformerEngine (TEGroupedMLP) or the
``grouped_gemm`` package (legacy GroupedMLP), neither of which is installed. Tokens reach the
experts through the alltoall dispatcher, which runs over gloo on the CPU and NCCL on CUDA. Routing replay uses megatron's own ``RouterReplay`` hook on the
router's top-k (``moe_enable_routing_replay``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

MOE_FAMILIES = ("qwen2_moe", "qwen3_moe", "glm4_moe", "deepseek_v3", "deepseek_v2")
#: Families whose routers score experts with a sigmoid and choose them with a correction bias (noaux_tc).
BIAS_ROUTED_FAMILIES = ("glm4_moe", "deepseek_v3")


@dataclass(frozen=True)
class MoEShape:
    """The MoE fields of an HF config (Qwen2-MoE / Qwen3-MoE / GLM-4.5)."""

    num_experts: int
    topk: int
    expert_intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int | None  # Qwen2-MoE: one gated shared expert; GLM: ungated
    shared_expert_gate: bool = False  # Qwen2-MoE's sigmoid gate on the shared expert's output
    hf_shared_experts: str = "shared_expert"  # the HF module's name: GLM's (and DeepSeek's) is shared_experts
    score_function: str = "softmax"  # "sigmoid" for noaux_tc routing (GLM-4.5, DeepSeek-V3)
    expert_bias: bool = False  # e_score_correction_bias: added to the scores to choose, not to weigh
    num_groups: int | None = None  # group-limited routing: experts in n_group groups ...
    group_topk: int | None = None  # ... of which topk_group are searched
    scaling_factor: float | None = None  # routed_scaling_factor on the routing weights
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP (GLM/DeepSeek: the first k)
    groups_by_best_expert: bool = False  # DeepSeek-V2: a group scores its best expert (deepseek_v2.py)

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.dense_layers


def moe_shape(hf_config, family: str) -> MoEShape:
    """Read and check the MoE fields."""
    if family in BIAS_ROUTED_FAMILIES:
        return _noaux_tc_shape(hf_config)
    if family == "deepseek_v2":
        from slime_rl.trainer_megatron.deepseek_v2 import deepseek_v2_moe_shape

        return deepseek_v2_moe_shape(hf_config)
    sparse_step = getattr(hf_config, "decoder_sparse_step", 1)
    dense_layers = list(getattr(hf_config, "mlp_only_layers", None) or [])
    if sparse_step != 1 or dense_layers:
        raise ValueError(
            "model.path: mixed dense and MoE layers (decoder_sparse_step != 1 or mlp_only_layers) are not"
            " supported; every layer must be an MoE layer"
        )
    shared = getattr(hf_config, "shared_expert_intermediate_size", None) if family == "qwen2_moe" else None
    return MoEShape(
        num_experts=hf_config.num_experts,
        topk=hf_config.num_experts_per_tok,
        expert_intermediate_size=hf_config.moe_intermediate_size,
        norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", family == "qwen3_moe")),
        shared_expert_intermediate_size=shared or None,
        shared_expert_gate=bool(shared),
    )


def check_groups(experts: int, groups: int, group_topk: int) -> None:
    """Expert groups a DeepSeek-style router can search: ``groups`` divides the experts, ``group_topk`` <= it."""
    if experts % groups or group_topk > groups:
        raise ValueError(f"model.path: n_group={groups} must divide the {experts} experts and be >= topk_group"
                         f" ({group_topk})")


def deepseek_layers(hf_config) -> tuple[int, int, float]:
    """(dense first layers, shared experts' intermediate size, routed scaling factor) of a DeepSeek-style MoE
    config (DeepSeek-V2/V3, GLM-4.5); refuses one whose dense layers leave no MoE layer."""
    dense = getattr(hf_config, "first_k_dense_replace", 0) or 0
    if dense >= hf_config.num_hidden_layers:
        raise ValueError(f"model.path: first_k_dense_replace={dense} leaves no MoE layer")
    shared = (getattr(hf_config, "n_shared_experts", 0) or 0) * hf_config.moe_intermediate_size
    return dense, shared, float(getattr(hf_config, "routed_scaling_factor", 1.0) or 1.0)


def _noaux_tc_shape(hf_config) -> MoEShape:
    """GLM-4.5's (and DeepSeek-V3's) MoE fields, refusing what megatron-core's router would compute
    differently from the HF model."""
    experts, topk = hf_config.n_routed_experts, hf_config.num_experts_per_tok
    # DeepSeek checkpoints name their routing; V2's (softmax, greedy or group-limited greedy) is not this one
    method, scoring = getattr(hf_config, "topk_method", "noaux_tc"), getattr(hf_config, "scoring_func", "sigmoid")
    if (method or "noaux_tc") != "noaux_tc" or (scoring or "sigmoid") != "sigmoid":
        raise ValueError(f"model.path: topk_method={method!r} with scoring_func={scoring!r} is not supported; the"
                         " trainer routes as DeepSeek-V3 and GLM-4.5 do (noaux_tc, sigmoid)")
    groups, group_topk = getattr(hf_config, "n_group", 1) or 1, getattr(hf_config, "topk_group", 1) or 1
    if not getattr(hf_config, "norm_topk_prob", True) and topk > 1:
        # megatron-core's sigmoid router always renormalises the top-k weights
        raise ValueError("model.path: norm_topk_prob=false with sigmoid routing is not supported")
    check_groups(experts, groups, group_topk)
    if groups > 1 and (topk % group_topk or topk // group_topk != 2):
        # HF (and SGLang) score a group by the sum of its 2 best biased scores; megatron-core by the sum
        # of its best num_experts_per_tok / topk_group (2 for GLM-4.5 and DeepSeek-V3: 8 / 4)
        raise ValueError(f"model.path: group-limited routing with num_experts_per_tok={topk} and"
                         f" topk_group={group_topk} is not supported; their ratio must be 2")
    dense, shared, scaling = deepseek_layers(hf_config)
    return MoEShape(
        num_experts=experts,
        topk=topk,
        expert_intermediate_size=hf_config.moe_intermediate_size,
        norm_topk_prob=True,
        shared_expert_intermediate_size=shared or None,
        hf_shared_experts="shared_experts",
        score_function="sigmoid",
        expert_bias=True,
        # one group: every expert is searched, as a plain top-k does
        num_groups=groups if groups > 1 else None,
        group_topk=group_topk if groups > 1 else None,
        scaling_factor=scaling if scaling != 1.0 else None,
        dense_layers=tuple(range(dense)),
    )


def doctor_lines() -> list[tuple[str, str]]:
    """``slime-cli doctor``'s ``moe`` section (entry point group ``slime_rl.doctor_checks``)."""
    return [("experts", expert_backend())]


def expert_backend() -> str:
    """Which expert MLP the trainer's MoE layers run here: grouped GEMM or one MLP per expert."""
    from slime_rl.trainer_megatron.grouped_experts import grouped_mm_available

    if grouped_mm_available():
        return ("grouped: torch._grouped_mm, one GEMM per projection for all local experts (CUTLASS on sm90+"
                " in bf16); trainer.megatron.moe_grouped_gemm=false for megatron's SequentialMLP")
    return ("sequential: this torch has no torch._grouped_mm, so the grouped experts loop over the experts"
            " (megatron's grouped GEMM needs TransformerEngine or grouped_gemm)")


def transformer_config_fields(moe: MoEShape, *, ep: int, etp: int, aux_loss_coeff: float,
                              z_loss_coeff: float | None, load_balancing_type: str,
                              routing_replay: bool) -> dict:
    """TransformerConfig fields for the MoE layers (routing as the family's HF model routes: see the module
    docstring)."""
    fields = dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.topk,
        moe_ffn_hidden_size=moe.expert_intermediate_size,
        moe_router_score_function=moe.score_function,
        moe_router_load_balancing_type=load_balancing_type,
        moe_aux_loss_coeff=aux_loss_coeff,
        moe_z_loss_coeff=z_loss_coeff,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        moe_shared_expert_intermediate_size=moe.shared_expert_intermediate_size,
        moe_shared_expert_gate=moe.shared_expert_gate,
        moe_shared_expert_overlap=False,
        moe_router_dtype="fp32",
        moe_enable_routing_replay=routing_replay,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    if moe.score_function == "softmax":
        # Qwen3 renormalises the top-k softmax (== softmax over the top-k logits); Qwen2-MoE keeps
        # the full softmax's probabilities (softmax first, then top-k).
        fields["moe_router_pre_softmax"] = not moe.norm_topk_prob
    if moe.expert_bias:
        # the checkpoint's e_score_correction_bias, frozen: a rate of 0 leaves it as loaded
        fields.update(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.0)
    if moe.num_groups is not None:
        fields.update(moe_router_num_groups=moe.num_groups, moe_router_group_topk=moe.group_topk)
    if moe.scaling_factor is not None:
        fields["moe_router_topk_scaling_factor"] = moe.scaling_factor
    return fields


def check_expert_parallel(moe: MoEShape | None, *, tp: int, ep: int, etp: int, sequence_parallel: bool = False) -> None:
    """Refuse layouts the trainer cannot run, naming the field and the fix."""
    if moe is None:
        if ep > 1 or etp > 1:
            raise ValueError("parallel.expert_model_parallel_size / expert_tensor_parallel_size: the model has no"
                             " experts; set both to 1")
        return
    if tp > 1 and not sequence_parallel:
        # megatron-core's MoE layer under TP works on the sequence-split hidden states (the router
        # and dispatcher each see this TP rank's share of the tokens): sequence_parallel.py
        raise ValueError("parallel.tensor_model_parallel_size: MoE models need sequence parallelism with TP > 1;"
                         " set parallel.sequence_parallel=true")
    if etp > 1 and ep == 1:
        raise ValueError("parallel.expert_tensor_parallel_size: > 1 needs parallel.expert_model_parallel_size > 1")
    if moe.num_experts % ep:
        raise ValueError(f"parallel.expert_model_parallel_size: {ep} must divide the model's {moe.num_experts}"
                         " experts")
    if moe.expert_intermediate_size % etp:
        raise ValueError(f"parallel.expert_tensor_parallel_size: {etp} must divide moe_intermediate_size"
                         f" ({moe.expert_intermediate_size})")


def reduce_expert_grads_over_tp(model: torch.nn.Module, *, tp: int, etp: int) -> None:
    """Experts split over fewer ranks than the dense layers (ETP < TP, SP on) are copies on those TP
    ranks, each fed its own share of the sequence: their gradients must be summed over the
    expert-data-parallel group, which holds those ranks. megatron-core sends expert gradients there
    only under EP (``allreduce=False``); otherwise they go over the data-parallel group, which does not."""
    if etp >= tp:
        return
    for name, param in model.named_parameters():
        if ".mlp.experts." in name:
            param.allreduce = False


def patch_megatron_without_te() -> None:
    """What megatron-core's MoE layer lacks without TransformerEngine, for the MoE layers built from now on:

    - 0.16.1's router GEMM reads ``te_general_gemm``, which is only defined when TransformerEngine
      imports: without TE the router raises NameError. None sends it to torch.mm.
    - Without TE's fused permutation the alltoall dispatcher copies the token counts to the host and
      waits for them (a stream sync) in every layer, and sorts the tokens by local expert even when
      they arrive sorted: `LocalDispatcher` skips both where one rank holds every expert."""
    from megatron.core.transformer.moe import moe_layer, moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    moe_layer.MoEAlltoAllTokenDispatcher = local_dispatcher_class()


@functools.cache
def local_dispatcher_class() -> type:
    """megatron-core's alltoall dispatcher, with `LocalDispatcher`'s shortcut (built on first use:
    this module imports without megatron-core, for ``slime-cli doctor``)."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    return type("LocalDispatcher", (LocalDispatcher, MoEAlltoAllTokenDispatcher), {})


class LocalDispatcher:
    """Mixed into megatron-core's ``MoEAlltoAllTokenDispatcher``: where this rank holds every expert
    and the whole sequence (expert-parallel and expert-TP size 1, dropless), the token counts stay on
    the device and the tokens go to the experts in the order the first permutation left them.

    megatron-core, unfused, copies the counts to the host (a side stream, then an event sync before
    its second permutation: the host waits for the GPU in every MoE layer) so that it can sort the
    received tokens by local expert with ``torch.split``/``torch.cat``; with one rank the received
    tokens are this rank's own, already sorted by expert, and that sort (and the unsort after the
    experts) copies every routed token for nothing, forward and backward. GroupedExperts reads the
    counts on the device (offsets of its grouped GEMM), so nothing here waits for the GPU; experts
    that need host counts (SequentialMLP's split) take them from the device tensor themselves.
    Same tokens, same order, same values. ``local`` False gives megatron-core's path back."""

    local = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.local = self.can_stay_local()

    def can_stay_local(self) -> bool:
        config = self.config
        return (self.ep_size == 1 and self.tp_size == 1 and not self.drop_and_pad
                and config.moe_expert_capacity_factor is None and not config.moe_permute_fusion
                and not getattr(config, "moe_router_padding_for_quantization", False))

    def _maybe_dtoh_and_synchronize(self, point: str, tokens_per_expert: torch.Tensor | None = None):
        if self.local:  # nothing needs the counts on the host
            return tokens_per_expert
        return super()._maybe_dtoh_and_synchronize(point, tokens_per_expert)

    def dispatch_postprocess(self, global_input_tokens: torch.Tensor, global_probs: torch.Tensor):
        if not self.local:
            return super().dispatch_postprocess(global_input_tokens, global_probs)
        tokens_per_expert, self.tokens_per_expert = self.tokens_per_expert, None
        return global_input_tokens, tokens_per_expert, global_probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not self.local:
            return super().combine_preprocess(hidden_states)
        return hidden_states


# ---------------------------------------------------------------- router statistics


class RouterStats:
    """Tokens per expert counted by every router of this rank's model (forward hooks), for the
    ``moe_expert_load_max`` / ``moe_expert_load_mean`` metrics (max over experts / mean, per layer)."""

    def __init__(self, model: torch.nn.Module):
        from megatron.core.transformer.moe.router import TopKRouter

        self.counts: dict[str, torch.Tensor] = {}  # by router name: the same order on every rank
        self.real_tokens: int | None = None  # count only the first this many tokens (SP: not TP's padding)
        self.hooks = []
        for name, module in model.named_modules():
            if isinstance(module, TopKRouter):
                self.hooks.append(module.register_forward_hook(self._hook(name)))

    def _hook(self, name: str):
        key = name  # (not hash(name): str hashes differ between processes, and so would the layers' order)

        def count(module, inputs, output):
            routing_map = output[1] if self.real_tokens is None else output[1][: self.real_tokens]
            # [experts], kept on the router's device: a copy to the host here would stall the GPU
            # once per layer and micro-batch; ``take`` moves the sums once per step
            load = routing_map.detach().sum(0).float()
            self.counts[key] = self.counts[key] + load if key in self.counts else load

        return count

    def reset(self) -> None:
        self.counts = {}

    def take(self, group=None) -> dict[str, float]:
        """Max-over-mean expert load averaged over this rank's layers, counted since the last
        ``reset``/``take`` and summed over ``group`` (the data-parallel ranks); then reset."""
        if not self.counts:
            return {}
        loads = torch.stack([self.counts[k] for k in sorted(self.counts)])  # [layers, experts]
        self.counts = {}
        if group is not None and torch.distributed.get_world_size(group) > 1:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.distributed.get_backend(
                group) == "nccl" else torch.device("cpu")
            loads = loads.to(device)
            torch.distributed.all_reduce(loads, group=group)
            loads = loads.cpu()
        ratios = loads.max(dim=1).values / loads.mean(dim=1).clamp_min(1e-9)
        return {"moe_expert_load_max_over_mean": float(ratios.mean())}


# ---------------------------------------------------------------- routing replay


class RoutingReplay:
    """Feeds the engine's expert choices to megatron's ``RouterReplay`` hooks of this rank's
    routers (``moe_enable_routing_replay``): each router then takes the given top-k instead of its
    own and weighs them by its own scores, so gradients still reach the router."""

    def __init__(self, model: torch.nn.Module):
        from megatron.core.transformer.moe.router import TopKRouter

        # this model's routers (megatron's global list also holds other models'), each with its global
        # layer index: the engine reports every layer, dense ones (GLM/DeepSeek's first) included
        self.replays = [(m.layer_number - 1, m.router_replay) for m in model.modules()
                        if isinstance(m, TopKRouter) and m.router_replay is not None]

    def use(self, routed: torch.Tensor | None, device: torch.device) -> None:
        """Replay ``routed`` (``[tokens, all layers, k]``, the router's token order) in the next
        forward; None: route as usual."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for layer, replay in self.replays:
            replay.clear_indices()
            if routed is None:
                replay.clear_router_replay_action()
                continue
            replay.set_target_indices(routed[:, layer].to(device, torch.int64).contiguous())
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def clear(self) -> None:
        self.use(None, torch.device("cpu"))
