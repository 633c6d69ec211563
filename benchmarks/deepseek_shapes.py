"""DeepSeek-V3 shapes of the trainer benchmarks (trainer_throughput.py, moe_replay_gap.py): their HF config fields,
FLOPs per token with multi-head latent attention (MLA), and the memory one GPU needs to train them with Adam next to
the transformers baseline.

``deepseek-v3-reduced``: DeepSeek-V3's real layer structure at a size one 80 GB GPU trains by each contender (ours
and transformers', one after the other in one process): a dense first layer then 3 MoE layers; MLA with V3's ranks
and head dims (q_lora_rank 1536, kv_lora_rank 512, q/k heads of 128 + 64 rotary dims, v heads of 128) and 16 heads
(V3 has 128 at hidden 7168; V2-Lite's 16 at hidden 2048); V2-Lite's hidden 2048, dense intermediate 10944 and 64
routed experts of 1408 with top-6; V3's routing (sigmoid scores plus the correction bias, noaux_tc) in 8 groups of
which 3 are searched (top-6 / 3 = 2 experts a group, the ratio V3's 8 / 4 has and the trainer needs), one shared
expert and routed scaling 2.5. 1.95B parameters, 0.58B a MoE layer. Its vocabulary is 32768, not V3's 129280: the
full one makes the two contenders' weights, gradients and Adam states alone 78.6 GiB (`memory_estimate`; 65.4 GiB
with 32768), and with 4 layers instead of 61 its LM head would be 44% of the weights a token goes through (2.5% in
V3). Plain RoPE (V3's YaRN changes no cost), no MTP layers.

``tiny-deepseek-v3``: the same structure at CPU size (4 layers, hidden 128, 8 experts in 2 groups, top-2).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeepseekShape:
    """What a DeepSeek-V3 shape adds to trainer_throughput's SHAPES and MOE rows."""

    q_lora_rank: int | None  # None: V2-Lite's q_proj, no q down-projection
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_shared_experts: int
    first_k_dense_replace: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


DEEPSEEK = {
    "tiny-deepseek-v3": DeepseekShape(q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=24, qk_rope_head_dim=16,
                                      v_head_dim=32, n_shared_experts=1, first_k_dense_replace=1, n_group=2,
                                      topk_group=1, routed_scaling_factor=2.5),
    "deepseek-v3-reduced": DeepseekShape(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                         v_head_dim=128, n_shared_experts=1, first_k_dense_replace=1, n_group=8,
                                         topk_group=3, routed_scaling_factor=2.5),
}

# bytes per parameter while both contenders are held: ours (megatron-core's bf16 mixed precision) keeps bf16
# weights (2), fp32 main gradients (4, grad_reduce_in_fp32), fp32 master weights (4) and Adam's two fp32 moments
# (8); transformers keeps fp32 weights (4) and gradients (4), AdamW's moments (8), and under bf16 autocast a bf16
# copy of every weight for the step (2)
TRAINER_BYTES_PER_PARAM = 18
BASELINE_BYTES_PER_PARAM = 16 + 2


def config_fields(shape: str, experts: int, topk: int, moe_intermediate: int) -> dict:
    """The DeepseekV3Config fields of ``shape`` beyond the dense ones (SHAPES), with the names DeepSeek's own
    configs carry and SGLang 0.5.17 reads (topk_method, scoring_func, moe_layer_freq: transformers' config has none
    of them, and SGLang's DeepseekV2ForCausalLM fails on a config without them)."""
    ds = DEEPSEEK[shape]
    return dict(n_routed_experts=experts, num_experts_per_tok=topk, moe_intermediate_size=moe_intermediate,
                n_shared_experts=ds.n_shared_experts, first_k_dense_replace=ds.first_k_dense_replace,
                n_group=ds.n_group, topk_group=ds.topk_group, norm_topk_prob=True,
                routed_scaling_factor=ds.routed_scaling_factor, topk_method="noaux_tc", scoring_func="sigmoid",
                moe_layer_freq=1,
                q_lora_rank=ds.q_lora_rank, kv_lora_rank=ds.kv_lora_rank, qk_nope_head_dim=ds.qk_nope_head_dim,
                qk_rope_head_dim=ds.qk_rope_head_dim, v_head_dim=ds.v_head_dim, num_nextn_predict_layers=0)


def active_params_per_token(shape: str, vocab: int, hidden: int, dense_intermediate: int, layers: int, heads: int,
                            experts: int, topk: int, moe_intermediate: int) -> int:
    """The weights one token multiplies through (the embedding lookup is free): per layer MLA's projections,
    q_a (hidden x q_lora) + q_b (q_lora x heads * qk_head) [or q_proj (hidden x heads * qk_head) without q_lora],
    kv_a (hidden x (kv_lora + rope)), kv_b (kv_lora x heads * (nope + v)), o (heads * v x hidden); the dense layers'
    MLP (3 x hidden x intermediate); the MoE layers' router (hidden x experts) and top-k routed plus the shared
    experts (3 x hidden x moe_intermediate each); the LM head (vocab x hidden)."""
    ds = DEEPSEEK[shape]
    q = (hidden * ds.q_lora_rank + ds.q_lora_rank * heads * ds.qk_head_dim if ds.q_lora_rank
         else hidden * heads * ds.qk_head_dim)
    kv = hidden * (ds.kv_lora_rank + ds.qk_rope_head_dim) + ds.kv_lora_rank * heads * (ds.qk_nope_head_dim
                                                                                       + ds.v_head_dim)
    attention = q + kv + heads * ds.v_head_dim * hidden
    dense = 3 * hidden * dense_intermediate
    moe = hidden * experts + 3 * hidden * moe_intermediate * (topk + ds.n_shared_experts)
    dense_layers = ds.first_k_dense_replace
    return layers * attention + dense_layers * dense + (layers - dense_layers) * moe + vocab * hidden


def attention_flops_per_token(shape: str, layers: int, heads: int, seq_len: int) -> int:
    """Training FLOPs of one token's attention in a ``seq_len``-token sample: q.k over qk_head_dim (nope + rope)
    and p.v over v_head_dim, 2 FLOPs a multiply-add, x3 for forward and backward:
    6 x layers x heads x (qk_head_dim + v_head_dim) x seq_len (12 x layers x heads x head_dim x seq_len when the
    two head dims are equal, the dense shapes' formula; like it, causality is not halved)."""
    ds = DEEPSEEK[shape]
    return 6 * layers * heads * (ds.qk_head_dim + ds.v_head_dim) * seq_len


def randomize_correction_bias(model, seed: int = 0) -> None:
    """Random ``e_score_correction_bias`` values (N(0, 0.05^2)) in every router of ``model``: a fresh model's are
    zeros, a real checkpoint's are learnt, and routing with zeros would not show whether an engine or the trainer
    chose experts by the biased scores."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.05)


def hf_param_count(config) -> int:
    """Parameters (and buffers: the correction bias) of the transformers model of ``config``, built on the meta
    device: exact, and instant at any size."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def memory_estimate(params: int) -> dict[str, float]:
    """GiB the two contenders' weights, gradients and optimizer states take on one GPU (activations not counted)."""
    trainer, baseline = params * TRAINER_BYTES_PER_PARAM / 2**30, params * BASELINE_BYTES_PER_PARAM / 2**30
    return {"trainer_gib": trainer, "baseline_gib": baseline, "total_gib": trainer + baseline}
