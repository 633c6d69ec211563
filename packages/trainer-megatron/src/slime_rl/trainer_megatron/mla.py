"""Multi-head latent attention (MLA: DeepSeek-V3 and DeepSeek-V2 / V2-Lite) in the Megatron trainer.

Our own module rather than megatron-core's ``MLASelfAttention``, which its local spec cannot build here: the local
``DotProductAttention`` takes no ``k_channels``/``v_channels``; ``HAVE_TE`` is True without TransformerEngine
(``extensions.transformer_engine`` substitutes MagicMocks), so its ``isinstance(..., TELinear)`` checks raise; and
the local spec's down-projections are column-parallel. Here core attention is ours (attention.py: padded SDPA,
per-sequence, or flash varlen with V padded to the q/k head dim), and under tensor parallelism (which needs sequence
parallelism here: MLA models are MoE models):

- the sequence is gathered once on the way in (``gather_from_sequence_parallel_region``; its backward reduce-scatters,
  summing each TP rank's heads' part of the input's gradient), as megatron-core's linear_qkv does under SP;
- the down-projections (q_a_proj, kv_a_proj_with_mqa with the decoupled rope key) and the latent norms are replicated:
  their input is the whole hidden state. Each rank's gradient of them is its own heads' part, so their weights are
  tagged ``sequence_parallel`` and megatron-core's ``finalize_model_grads`` sums them over TP, as it does the norms';
- the up-projections (q_b_proj, kv_b_proj; V2-Lite's q_proj) are column-parallel by heads (each rank's rows are its
  heads' ``[nope | rope]`` or ``[k nope | v]`` blocks, so HF's tensors split on dim 0 as they are) and take the
  gathered input as it is (no second gather, no all-reduce of their input's gradient);
- o_proj is row-parallel, reduce-scattering its output over the sequence.

As transformers' ``DeepseekV3Attention`` computes it (the names are megatron-core's MLA names; convert.py maps them
one to one onto HF's, no tensor is fused or permuted):

- queries: ``linear_q_down_proj`` (q_a_proj) -> ``q_layernorm`` (q_a_layernorm) -> ``linear_q_up_proj`` (q_b_proj),
  or one ``linear_q_proj`` (q_proj) where ``q_lora_rank`` is null (V2-Lite); per head ``[nope | rope]`` dims.
- keys and values: ``linear_kv_down_proj`` (kv_a_proj_with_mqa) gives the latent ``[kv_lora_rank | rope]``; the
  latent goes through ``kv_layernorm`` (kv_a_layernorm) and ``linear_kv_up_proj`` (kv_b_proj) to per-head
  ``[k nope | v]``; the rope part is one key shared by all heads (decoupled RoPE).
- RoPE on the rope dims only. DeepSeek's checkpoints hold them as interleaved pairs (``rope_interleave``): they are
  de-interleaved (evens, then odds) before Megatron's half-split RoPE, which is what transformers' interleaved
  formula computes. YaRN: the frequencies and the cos/sin factor (``rope_mscale``) as transformers computes them,
  and the softmax scale times ``mscale(factor, mscale_all_dim)^2``.
- The a-norms' epsilon is 1e-6 whatever ``rms_norm_eps`` says: transformers (and DeepSeek's own code) build them
  with their default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from slime_rl.trainer_megatron.attention import SDPAttention

#: The families whose attention is MLA: DeepSeek-V3 and DeepSeek-V2 / V2-Lite (the same attention; V2 routes otherwise).
MLA_FAMILIES = ("deepseek_v3", "deepseek_v2")
_A_NORM_EPS = 1e-6  # DeepseekV3RMSNorm's default, which q_a_layernorm and kv_a_layernorm are built with


@dataclass(frozen=True)
class MLAShape:
    """The MLA fields of an HF config."""

    q_lora_rank: int | None  # None: one q_proj, no q down-projection (V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # the rope dims are stored as interleaved pairs
    softmax_scale: float  # qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2
    rope_mscale: float = 1.0  # YaRN's factor on cos and sin (transformers' attention_factor)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def mla_shape(hf_config, rope: dict) -> MLAShape:
    """Read and check the MLA fields; ``rope``: the config's rope parameters (transformers 5's rope_parameters or
    4.x's rope_scaling)."""
    if getattr(hf_config, "attention_bias", False):
        raise ValueError("model.path: attention_bias=true with multi-head latent attention is not supported")
    q_lora_rank = getattr(hf_config, "q_lora_rank", None)
    nope, rope_dim = hf_config.qk_nope_head_dim, hf_config.qk_rope_head_dim
    if rope_dim % 2:
        raise ValueError(f"model.path: qk_rope_head_dim={rope_dim} must be even")
    heads, kv_heads = hf_config.num_attention_heads, getattr(hf_config, "num_key_value_heads", None)
    if kv_heads not in (None, heads):
        raise ValueError(f"model.path: num_key_value_heads={kv_heads} with multi-head latent attention; MLA expands"
                         f" keys and values for every one of the {heads} heads")
    scale = (nope + rope_dim) ** -0.5
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "linear", "yarn"):
        raise ValueError(f"model.path: rope_type={rope_type!r} with multi-head latent attention is not supported"
                         " (default, linear, yarn)")
    rope_mscale = 1.0
    if rope_type == "yarn":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        _, rope_mscale = ROPE_INIT_FUNCTIONS["yarn"](hf_config, torch.device("cpu"))
    if rope_type != "default" and rope.get("mscale_all_dim"):  # as transformers' yarn_apply_mscale reads it
        mscale = yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"]))
        scale *= mscale * mscale
    return MLAShape(q_lora_rank=q_lora_rank or None, kv_lora_rank=hf_config.kv_lora_rank, qk_nope_head_dim=nope,
                    qk_rope_head_dim=rope_dim, v_head_dim=hf_config.v_head_dim,
                    rope_interleave=bool(getattr(hf_config, "rope_interleave", True)), softmax_scale=scale,
                    rope_mscale=float(rope_mscale))


def projection_params(mla: MLAShape, heads: int, hidden: int) -> int:
    """The weights of one MLA layer's projections (q, kv down and up, o): ~2 forward FLOPs a token each."""
    q = (hidden * mla.q_lora_rank + mla.q_lora_rank * heads * mla.qk_head_dim if mla.q_lora_rank
         else hidden * heads * mla.qk_head_dim)
    kv = hidden * (mla.kv_lora_rank + mla.qk_rope_head_dim) + mla.kv_lora_rank * heads * (mla.qk_nope_head_dim
                                                                                          + mla.v_head_dim)
    return q + kv + heads * mla.v_head_dim * hidden


def hf_tensor_shape(mla: MLAShape, name: str, heads: int, hidden: int) -> tuple[int, ...] | None:
    """The shape of the HF attention tensor ``name`` (``...self_attn.<module>.weight``) of an MLA layer; None for
    a tensor outside the attention."""
    if ".self_attn." not in name:
        return None
    q_rank, kv_rank = mla.q_lora_rank, mla.kv_lora_rank
    shapes = {"q_proj": (heads * mla.qk_head_dim, hidden), "q_a_proj": (q_rank, hidden), "q_a_layernorm": (q_rank,),
              "q_b_proj": (heads * mla.qk_head_dim, q_rank),
              "kv_a_proj_with_mqa": (kv_rank + mla.qk_rope_head_dim, hidden), "kv_a_layernorm": (kv_rank,),
              "kv_b_proj": (heads * (mla.qk_nope_head_dim + mla.v_head_dim), kv_rank),
              "o_proj": (hidden, heads * mla.v_head_dim)}
    return shapes[name.split(".self_attn.", 1)[1].split(".", 1)[0]]


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature, as DeepSeek defines it (transformers' yarn_get_mscale)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Interleaved rope pairs ``(x0, x1), (x2, x3), ...`` -> ``[x0, x2, ..., x1, x3, ...]`` (half-split RoPE's layout)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class ReplicatedLinear(torch.nn.Module):
    """A bias-free linear every TP rank holds whole (MLA's down-projections), called as Megatron's linears are:
    ``x -> (x @ W^T, None)``. Its weight is tagged ``sequence_parallel`` (see the module docstring)."""

    def __init__(self, inputs: int, outputs: int, config):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(outputs, inputs, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return torch.nn.functional.linear(x, self.weight), None


class MultiLatentSelfAttention(MegatronModule):
    """DeepSeek's MLA as a Megatron self-attention module (the layer calls it as it calls SelfAttention and gets
    ``(output, bias)``), over our core attention; TP > 1 with sequence parallelism (the module docstring)."""

    def __init__(self, config, submodules=None, layer_number: int = 1,
                 attn_mask_type: AttnMaskType = AttnMaskType.causal, *, mla: MLAShape, **unused):
        super().__init__(config=config)
        self.mla = mla
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        tp = config.tensor_model_parallel_size
        if tp > 1 and not config.sequence_parallel:
            # the replicated weights' gradients are summed over TP only for sequence-parallel tensors
            raise ValueError("parallel.sequence_parallel: multi-head latent attention with TP > 1 needs it; set"
                             " parallel.sequence_parallel=true")
        heads = config.num_attention_heads
        self.num_heads = heads // tp  # this TP rank's heads

        def by_heads(inputs: int, outputs: int) -> tensor_parallel.ColumnParallelLinear:
            linear = tensor_parallel.ColumnParallelLinear(
                inputs, outputs, config=config, init_method=config.init_method, bias=False, gather_output=False,
                disable_grad_reduce=True)  # its input's gradient is summed by the gather in forward
            linear.sequence_parallel = False  # its input is already the whole sequence
            return linear

        def norm(size: int) -> torch.nn.RMSNorm:
            latent_norm = torch.nn.RMSNorm(size, eps=_A_NORM_EPS, dtype=config.params_dtype)
            latent_norm.weight.sequence_parallel = config.sequence_parallel  # replicated: summed over TP
            return latent_norm

        hidden = config.hidden_size
        if mla.q_lora_rank is None:
            self.linear_q_proj = by_heads(hidden, heads * mla.qk_head_dim)
        else:
            self.linear_q_down_proj = ReplicatedLinear(hidden, mla.q_lora_rank, config)
            self.q_layernorm = norm(mla.q_lora_rank)
            self.linear_q_up_proj = by_heads(mla.q_lora_rank, heads * mla.qk_head_dim)
        self.linear_kv_down_proj = ReplicatedLinear(hidden, mla.kv_lora_rank + mla.qk_rope_head_dim, config)
        self.kv_layernorm = norm(mla.kv_lora_rank)
        self.linear_kv_up_proj = by_heads(mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim))
        self.core_attention = SDPAttention(config, layer_number, attn_mask_type, "self",
                                           softmax_scale=mla.softmax_scale)
        # trainer.megatron.recompute: [core_attn], as megatron-core's Attention reads it
        self.checkpoint_core_attention = (config.recompute_granularity == "selective"
                                          and "core_attn" in (config.recompute_modules or ()))
        self.linear_proj = tensor_parallel.RowParallelLinear(
            heads * mla.v_head_dim, hidden, config=config, init_method=config.output_layer_init_method, bias=False,
            input_is_parallel=True, skip_bias_add=True)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, *, rotary_pos_emb=None,
                packed_seq_params=None, **unused):
        """``hidden_states`` ``[s, b, hidden]`` (packed: ``[t, 1, hidden]``) -> ``(output, bias)``."""
        mla, heads = self.mla, self.num_heads
        if self.config.sequence_parallel:  # [s / TP, b, h] -> [s, b, h]; backward sums the TP ranks' parts
            hidden_states = tensor_parallel.gather_from_sequence_parallel_region(hidden_states)
        s, b, _ = hidden_states.shape
        if mla.q_lora_rank is None:
            q, _ = self.linear_q_proj(hidden_states)
        else:
            q_latent, _ = self.linear_q_down_proj(hidden_states)
            q, _ = self.linear_q_up_proj(self.q_layernorm(q_latent))
        q_nope, q_rot = q.view(s, b, heads, mla.qk_head_dim).split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], -1)
        latent, _ = self.linear_kv_down_proj(hidden_states)
        kv_latent, k_rot = latent.split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        kv, _ = self.linear_kv_up_proj(self.kv_layernorm(kv_latent))
        k_nope, value = kv.view(s, b, heads, -1).split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
        k_rot = k_rot.view(s, b, 1, mla.qk_rope_head_dim)
        if mla.rope_interleave:
            q_rot, k_rot = _deinterleave(q_rot), _deinterleave(k_rot)
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if packed:  # thd: [t, heads, dim], as core attention takes packed micro-batches
            q_nope, q_rot, k_nope, k_rot, value = (x.squeeze(1) for x in (q_nope, q_rot, k_nope, k_rot, value))
        if rotary_pos_emb is not None:
            q_rot, k_rot = self._rope(q_rot, k_rot, rotary_pos_emb, packed_seq_params if packed else None)
        query = torch.cat([q_nope, q_rot], dim=-1)
        key = torch.cat([k_nope, k_rot.expand(*k_nope.shape[:-1], -1)], dim=-1)
        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return self.core_attention(q, k, v, attention_mask, attn_mask_type=self.attn_mask_type,
                                       packed_seq_params=packed_seq_params)

        if self.checkpoint_core_attention and self.training:  # attention's scores recomputed in backward
            out = tensor_parallel.checkpoint(attend, False, query, key, value)
        else:
            out = attend(query, key, value)
        if packed:
            out = out.reshape(out.size(0), 1, -1)  # [t, 1, heads * v_head_dim], as the layer expects
        return self.linear_proj(out)

    def _rope(self, q_rot: torch.Tensor, k_rot: torch.Tensor, rotary_pos_emb, packed_seq_params):
        """Megatron's RoPE (GPTModel's, of qk_rope_head_dim: model.transformer_config sets kv_channels to it) on the
        rope dims; YaRN's cos/sin factor applied after it (RoPE is linear), as the fused kernels ignore ``mscale``."""
        q_freqs, k_freqs = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
        cu_seqlens = None
        if packed_seq_params is not None:
            cu_seqlens = packed_seq_params.cu_seqlens_q_padded
            if cu_seqlens is None:
                cu_seqlens = packed_seq_params.cu_seqlens_q
        q_rot = apply_rotary_pos_emb(q_rot, q_freqs, config=self.config, cu_seqlens=cu_seqlens)
        k_rot = apply_rotary_pos_emb(k_rot, k_freqs, config=self.config, cu_seqlens=cu_seqlens)
        if self.mla.rope_mscale != 1.0:
            q_rot, k_rot = q_rot * self.mla.rope_mscale, k_rot * self.mla.rope_mscale
        return q_rot, k_rot
