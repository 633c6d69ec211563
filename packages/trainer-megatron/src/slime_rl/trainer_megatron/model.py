"""A Hugging Face config -> a Megatron GPTModel (local layer spec) for Llama, Qwen2/2.5, Qwen3, and the
mixture-of-experts Qwen3-MoE, Qwen2-MoE, GLM-4.5, DeepSeek-V3 and DeepSeek-V2 (moe.py, deepseek_v2.py; their
first layers are dense; DeepSeek's attention is multi-head latent attention, mla.py); Qwen2.5-VL is Qwen2 with
mRoPE and a vision tower (vlm.py, vision.py), Qwen3-VL Qwen3 with interleaved mRoPE, its own tower and deepstack
(vision_qwen3.py).

The model returns the final hidden states (after the last RMSNorm) instead of logits:
``logprobs.py`` applies the output layer in chunks, so full-vocabulary logits for a
whole micro-batch are never materialised. Core attention is torch's
``scaled_dot_product_attention`` (flash/efficient kernels on CUDA, the fused CPU
kernel on the CPU; one flash varlen call per layer for packed micro-batches on CUDA: attention.py)
instead of the local spec's unfused baddbmm + softmax.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import transformer_block
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from slime_rl.trainer_megatron import fused_rope, sequence_parallel
from slime_rl.trainer_megatron.attention import PACKED_ATTENTION_CHOICES, SDPAttention
from slime_rl.trainer_megatron.grouped_experts import GroupedExperts
from slime_rl.trainer_megatron.mla import (
    MLA_FAMILIES,
    MLAShape,
    MultiLatentSelfAttention,
    mla_shape,
    projection_params,
)
from slime_rl.trainer_megatron.moe import MOE_FAMILIES, MoEShape, moe_shape
from slime_rl.trainer_megatron.support import SUPPORTED_ARCHITECTURES, architecture_family
from slime_rl.trainer_megatron.vision import VisionShape


@dataclass(frozen=True)
class HFModelShape:
    """What the conversion and the model need from an HF config.json."""

    family: str  # llama | qwen2 | qwen3 | qwen3_moe | qwen2_moe | glm4_moe | deepseek_v3 | deepseek_v2 | qwen2_5_vl
    # | qwen3_vl
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # MLA: qk_rope_head_dim, the dims Megatron's RoPE rotates (the rest are in ``mla``)
    rms_norm_eps: float
    rope_theta: float
    rope_type: str
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    moe: MoEShape | None = None  # the experts of an MoE family, None for dense models
    rotary_percent: float = 1.0  # the share of each head's dims that RoPE rotates (GLM-4.5: 0.5)
    mtp_layers: int = 0  # multi-token-prediction layers in the checkpoint: not built, carried through (convert.py)
    mla: MLAShape | None = None  # DeepSeek-V3's multi-head latent attention, None for q/k/v attention
    vision: VisionShape | None = None  # a vision-language model's vision tower and mRoPE (vlm.py), None for text


def read_hf_config(path: str | Path):
    """The transformers config object of a local HF folder (never downloads)."""
    from transformers import AutoConfig

    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"model.path: {config_file} does not exist; give a local Hugging Face model folder")
    return AutoConfig.from_pretrained(str(path), local_files_only=True)


def hf_model_shape(hf_config) -> HFModelShape:
    try:
        family = architecture_family({"architectures": getattr(hf_config, "architectures", None),
                                      "model_type": getattr(hf_config, "model_type", None)})
    except ValueError as err:
        raise ValueError(f"model.path: {err}") from None
    if family in ("qwen2_5_vl", "qwen3_vl"):  # the Qwen2/Qwen3 language model of text_config, plus the vision tower
        from slime_rl.trainer_megatron.vlm import vl_model_shape

        return vl_model_shape(hf_config, hf_model_shape)
    arch = next(name for name, named in SUPPORTED_ARCHITECTURES.items() if named == family)
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"model.path: hidden_act={act!r} is not supported (only silu/SwiGLU)")
    if getattr(hf_config, "mlp_bias", False):
        raise ValueError("model.path: mlp_bias=true is not supported")
    quantization = getattr(hf_config, "quantization_config", None)
    if quantization:  # DeepSeek-V3's release is block-FP8: its weights need their scale_inv tensors to mean anything
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        raise ValueError(f"model.path: a quantized checkpoint (quantization_config: {method}) is not supported; convert"
                         " it to bf16 first (DeepSeek-V3: its inference/fp8_cast_bf16.py)")
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError("model.path: use_sliding_window=true is not supported; set it to false in config.json")
    # transformers 5: rope_parameters holds theta and scaling; 4.x: rope_theta and rope_scaling
    rope = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    rope_theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    mla = mla_shape(hf_config, rope) if family in MLA_FAMILIES else None
    if mla is not None:  # Megatron's RoPE (kv_channels) rotates the rope dims; every head has its keys and values
        head_dim, num_kv_heads = mla.qk_rope_head_dim, heads
    else:
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if family in ("qwen2", "qwen2_moe"):
        qkv_bias = True  # Qwen2 always has q/k/v biases
    else:
        qkv_bias = bool(getattr(hf_config, "attention_bias", False))
    # GLM-4.5 makes q/k norms a config choice; Qwen3 always has them
    qk_norm = family in ("qwen3", "qwen3_moe") or (family == "glm4_moe" and bool(getattr(hf_config, "use_qk_norm", False)))
    # transformers 5 keeps partial_rotary_factor in rope_parameters, 4.x on the config
    rotary_percent = float(rope.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)) or 1.0)
    if mla is not None and rotary_percent != 1.0:
        raise ValueError(f"model.path: partial_rotary_factor={rotary_percent} with multi-head latent attention; its"
                         " rope dims are qk_rope_head_dim")
    if int(head_dim * rotary_percent) % 2:
        raise ValueError(f"model.path: partial_rotary_factor={rotary_percent} rotates an odd number of head dims")
    return HFModelShape(
        family=family,
        architecture=arch,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=hf_config.rms_norm_eps,
        rope_theta=float(rope_theta),
        rope_type=rope_type,
        max_position_embeddings=hf_config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        moe=moe_shape(hf_config, family) if family in MOE_FAMILIES else None,
        rotary_percent=rotary_percent,
        mtp_layers=int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0),  # GLM-4.5 and DeepSeek-V3
        mla=mla,
    )


def attention_cost_weight(shape: HFModelShape) -> float:
    """Causal attention's compute per token per token of context, relative to the rest of a layer's
    per-token compute: a sample of ``L`` tokens costs about ``L * (1 + weight * L)`` (batching.sample_costs).
    Forward FLOPs per token: ~2 per weight of the layer's matmuls (the active experts of an MoE layer),
    and 2 * heads * head_dim per earlier token for QK^T and attention x V (L / 2 of them on average)."""
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    projections = shape.hidden_size * (2 * q + 2 * kv)
    if shape.mla is not None:  # QK^T over the q/k head dim, attention x V over the v head dim
        q = shape.num_heads * (shape.mla.qk_head_dim + shape.mla.v_head_dim) // 2
        projections = projection_params(shape.mla, shape.num_heads, shape.hidden_size)
    dense_mlp = 3 * shape.hidden_size * shape.intermediate_size
    if shape.moe is not None:
        moe = shape.moe
        moe_mlp = shape.hidden_size * (moe.num_experts + 3 * moe.expert_intermediate_size * moe.topk
                                       + 3 * (moe.shared_expert_intermediate_size or 0))
        dense = len(moe.dense_layers)  # GLM/DeepSeek: the first layers' MLPs are dense
        mlp = (dense * dense_mlp + (shape.num_layers - dense) * moe_mlp) / shape.num_layers
    else:
        mlp = dense_mlp
    return q / (projections + mlp)


def check_parallel_fits(shape: HFModelShape, tp: int, pp: int, cp: int = 1) -> None:
    if shape.mla is not None and cp > 1:
        raise ValueError(f"parallel.context_parallel_size: multi-head latent attention (DeepSeek-V3) runs at CP=1 (here"
                         f" CP={cp}); spread the sequence with parallel.tensor_model_parallel_size and"
                         " parallel.sequence_parallel, the experts with parallel.expert_model_parallel_size")
    if shape.num_heads % tp:
        raise ValueError(f"parallel.tensor_model_parallel_size: {tp} must divide the model's {shape.num_heads} heads")
    if shape.num_kv_heads % tp:
        raise ValueError(
            f"parallel.tensor_model_parallel_size: {tp} must divide the model's {shape.num_kv_heads} KV heads"
        )
    if shape.vocab_size % tp:
        raise ValueError(f"parallel.tensor_model_parallel_size: {tp} must divide the vocabulary ({shape.vocab_size})")
    if shape.intermediate_size % tp:
        raise ValueError(f"parallel.tensor_model_parallel_size: {tp} must divide intermediate_size")
    if shape.num_layers % pp:
        raise ValueError(f"parallel.pipeline_model_parallel_size: {pp} must divide the model's {shape.num_layers} layers")


def transformer_config(
    shape: HFModelShape, *, tp: int, pp: int, dtype: torch.dtype, recompute: bool | list[str] = False,
    sequence_parallel: bool = False, compiled_fusions: bool = False, moe_fields: dict | None = None,
    packed_attention: str = "auto", context_parallel_size: int = 1,
) -> TransformerConfig:
    """The TransformerConfig for ``shape``: RMSNorm, SwiGLU, RoPE, GQA, no biases but Qwen's QKV.
    ``compiled_fusions``: Megatron's torch.compile'd SwiGLU (one kernel each way, and backward
    keeps only the MLP's input) and a compiled RoPE in TransformerEngine's place (fused_rope.py);
    for CUDA, where inductor's Triton kernels pay. ``recompute``: True for full recompute,
    or Megatron's selective recompute of the modules named (e.g. ``["core_attn", "mlp"]``).
    ``moe_fields``: the MoE layer's fields (`moe.transformer_config_fields`) for an MoE model.
    ``packed_attention``: how packed micro-batches attend (attention.py), ``auto`` by default.
    ``context_parallel_size``: CP (context_parallel.py; our attention, not TransformerEngine's)."""
    if packed_attention not in PACKED_ATTENTION_CHOICES:
        raise ValueError(f"trainer.megatron.packed_attention: {packed_attention!r}; use one of"
                         f" {', '.join(PACKED_ATTENTION_CHOICES)}")
    if compiled_fusions:
        fused_rope.install()  # before the config: its checks look for the fused RoPE functions
    extra = {"bias_activation_fusion": compiled_fusions, "apply_rope_fusion": compiled_fusions, **(moe_fields or {}),
             **_moe_layer_pattern(shape),
             "context_parallel_size": context_parallel_size,
             **({"mrope_section": list(shape.vision.mrope_section)} if shape.vision is not None else {}),
             "sequence_parallel": sequence_parallel and tp > 1}  # our own norms allow it (sequence_parallel.py)
    if recompute is True:
        extra.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif recompute:
        extra.update(recompute_granularity="selective", recompute_modules=list(recompute))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="full scope is deprecated")  # a default we do not use
        config = _make_transformer_config(shape, tp, pp, dtype, extra)
    # Micro-batches of different lengths (dynamic batching, packing) under PP. Set after
    # construction: __post_init__ refuses it with the (unused here) MoE allgather dispatcher.
    config.variable_seq_lengths = True
    config.packed_attention = packed_attention  # read by SDPAttention; not a Megatron field
    return config


def _moe_layer_pattern(shape: HFModelShape) -> dict:
    """``moe_layer_freq`` as a list (1: MoE layer, 0: dense) where some layers are dense (GLM/DeepSeek's
    first ``first_k_dense_replace``): megatron-core then names their weights per layer in distributed checkpoints."""
    if shape.moe is None or not shape.moe.dense_layers:
        return {}
    return {"moe_layer_freq": [int(shape.moe.is_moe_layer(i)) for i in range(shape.num_layers)]}


def _make_transformer_config(shape: HFModelShape, tp: int, pp: int, dtype: torch.dtype, extra: dict):
    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.intermediate_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=shape.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # Weights come from the HF checkpoint: skip random init (and the time it takes).
        use_cpu_initialization=True,
        perform_initialization=False,
        # These fused paths need TransformerEngine or Apex.
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        # Losses arrive already normalised by the global token/sequence counts (see trainer.py).
        calculate_per_token_loss=True,
        **extra,
    )


class PolicyGPT(GPTModel):
    """GPTModel whose last stage returns the final hidden states ``[s, b, h]``.

    The output layer's weight still lives here (``output_layer`` or the tied
    embedding) and is applied by ``logprobs.py``; a critic adds ``value_head``.
    """

    def __init__(self, *args, value_head: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.value_head = None
        if value_head and self.post_process:
            self.value_head = torch.nn.Linear(self.config.hidden_size, 1, bias=True, dtype=self.config.params_dtype)
            torch.nn.init.zeros_(self.value_head.weight)
            torch.nn.init.zeros_(self.value_head.bias)

    def _postprocess(self, hidden_states, *args, **kwargs):
        return hidden_states

    def output_weight(self) -> torch.Tensor:
        """This TP rank's slice of the LM head, ``[vocab / tp, hidden]`` (last stage only)."""
        if self.share_embeddings_and_output_weights:
            return self.shared_embedding_or_output_weight()
        return self.output_layer.weight


def layer_spec(shape: HFModelShape, *, grouped_experts: bool = True, moe_layer: bool = True):
    """The local spec with SDPA attention; an MoE model's experts are ``GroupedExperts`` (one grouped
    GEMM per projection) unless ``grouped_experts`` is false (Megatron's SequentialMLP). ``moe_layer``
    false: the dense-MLP layer of a model whose first layers are dense (GLM/DeepSeek)."""
    num_experts = shape.moe.num_experts if shape.moe and moe_layer else None
    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=shape.qk_norm,
                                    normalization="RMSNorm")
    if shape.mla is not None:  # our MLA module, its core attention SDPAttention (mla.py)
        spec.submodules.self_attention = ModuleSpec(module=MultiLatentSelfAttention,
                                                    params={"attn_mask_type": AttnMaskType.causal, "mla": shape.mla})
    else:
        attention = spec.submodules.self_attention.submodules
        spec.submodules.self_attention.submodules = dataclasses.replace(attention, core_attention=SDPAttention)
    if num_experts is not None and grouped_experts:
        spec.submodules.mlp = _with_experts(spec.submodules.mlp, GroupedExperts)
    return spec


def stage_layer_specs(shape: HFModelShape, config: TransformerConfig, *, grouped_experts: bool = True) -> list:
    """The specs of this pipeline stage's layers, dense or MoE as each global layer is."""
    moe_spec = layer_spec(shape, grouped_experts=grouped_experts)
    dense_spec = layer_spec(shape, moe_layer=False) if shape.moe is not None and shape.moe.dense_layers else None
    first = get_transformer_layer_offset(config)
    layers = range(first, first + get_num_layers_to_build(config))
    return [dense_spec if dense_spec is not None and not shape.moe.is_moe_layer(i) else moe_spec for i in layers]


def _with_experts(moe_spec, experts: type):
    """The MoE layer's spec with ``experts`` as its experts module: a ModuleSpec in megatron-core
    0.16, a functools.partial of MoELayer in 0.19 (both hold a MoESubmodules dataclass)."""
    if isinstance(moe_spec, functools.partial):
        submodules = dataclasses.replace(moe_spec.keywords["submodules"], experts=experts)
        return functools.partial(moe_spec.func, *moe_spec.args, **{**moe_spec.keywords, "submodules": submodules})
    return dataclasses.replace(moe_spec, submodules=dataclasses.replace(moe_spec.submodules, experts=experts))


def build_model(shape: HFModelShape, config: TransformerConfig, hf_config, *, value_head: bool = False,
                grouped_experts: bool = True) -> PolicyGPT:
    """This rank's pipeline stage of the model (weights uninitialised until convert.load_hf)."""
    vl = {} if shape.vision is None else {"vision": shape.vision}
    if vl:
        from slime_rl.trainer_megatron.vlm import PolicyVLM
    model = (PolicyVLM if vl else PolicyGPT)(
        config=config,
        transformer_layer_spec=_block_spec(stage_layer_specs(shape, config, grouped_experts=grouped_experts), config),
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=shape.tie_word_embeddings,
        position_embedding_type="mrope" if vl else "rope",
        rotary_base=shape.rope_theta,
        rotary_percent=shape.rotary_percent,
        value_head=value_head,
        **vl,
    )
    _apply_hf_rope_scaling(model, shape, hf_config)
    _mark_tensor_parallel_weights(model)
    if shape.moe is not None and shape.moe.groups_by_best_expert:  # DeepSeek-V2's group-limited greedy routing
        from slime_rl.trainer_megatron.deepseek_v2 import score_groups_by_best_expert

        score_groups_by_best_expert(model)
    return model


def _block_spec(layer_specs: list, config: TransformerConfig):
    """The decoder block of this stage's layers (one layer spec where all are alike, as megatron-core takes it;
    a TransformerBlockSubmodules where dense and MoE layers mix); under sequence parallelism every norm is our SP-aware
    one (megatron's torch norms refuse SP)."""
    if config.sequence_parallel:
        return sequence_parallel.with_local_norms(layer_specs, config)
    if all(spec is layer_specs[0] for spec in layer_specs):
        return layer_specs[0]  # one spec for every layer: megatron-core builds the block as it always has
    # mixed dense and MoE layers: the final norm megatron-core would pick for a single spec
    return TransformerBlockSubmodules(layer_specs=layer_specs, layer_norm=transformer_block.LayerNormImpl)


def _mark_tensor_parallel_weights(model: torch.nn.Module) -> None:
    """Tag TP-split weights as such. megatron-core 0.16 only does it inside random init, which we
    skip (perform_initialization=False); without the tags the grad norm counts only TP rank 0's
    slices. 0.19 tags them either way, and then this changes nothing."""
    split_dim = {
        tensor_parallel.ColumnParallelLinear: 0,
        tensor_parallel.RowParallelLinear: 1,
        tensor_parallel.VocabParallelEmbedding: 0,
    }
    for module in model.modules():
        dim = next((d for cls, d in split_dim.items() if isinstance(module, cls)), None)
        weight = getattr(module, "weight", None)
        if dim is not None and isinstance(weight, torch.nn.Parameter) and not getattr(weight, "tensor_model_parallel", False):
            tensor_parallel.set_tensor_model_parallel_attributes(weight, True, dim, 1)


def _apply_hf_rope_scaling(model: PolicyGPT, shape: HFModelShape, hf_config) -> None:
    """RoPE scaling as transformers computes it (linear, llama3, ...): set Megatron's inverse frequencies."""
    if shape.rope_type == "default":
        return
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if shape.rope_type not in ROPE_INIT_FUNCTIONS or shape.rope_type in ("dynamic", "longrope"):
        raise ValueError(f"model.path: rope_type={shape.rope_type!r} is not supported (default, linear, llama3, yarn)")
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[shape.rope_type](hf_config, torch.device("cpu"))
    if abs(attention_factor - 1.0) > 1e-12 and shape.mla is None:  # MLA applies it to its rope dims (mla.py)
        raise ValueError(f"model.path: rope_type={shape.rope_type!r} with attention factor {attention_factor} != 1")
    rotary = getattr(model, "rotary_pos_emb", None)
    if rotary is not None:
        rotary.inv_freq = inv_freq.float()
        type(rotary).forward.cache_clear()  # RoPE embeddings are lru-cached per sequence length
