"""Sequence parallelism (``parallel.sequence_parallel``) with tensor parallelism, without TransformerEngine or Apex.

Under SP the activations outside attention and the MLP (the norms, the residual stream, the MoE
router) hold ``1 / TP`` of the sequence on each TP rank: the local spec's column-parallel linears
all-gather the sequence on the way in and the row-parallel ones reduce-scatter it on the way out
(megatron-core's own SP path). What the local spec lacks is a norm that allows it: megatron-core's
``WrappedTorchNorm`` asserts ``not config.sequence_parallel``. ``LocalNorm`` is the same torch norm
with its weights tagged ``sequence_parallel``, so that megatron-core's ``finalize_model_grads``
sums their gradients (each TP rank's share of the sequence) over the TP group, as it does for
TransformerEngine's norms; the MoE router and Qwen2-MoE's shared-expert gate tag themselves.

The trainer's side: each micro-batch's sequence is padded to a multiple of TP (``pad_micro_batch``:
padding after every real token, which causal attention keeps out of them), and the last stage
gathers the final hidden states over TP before the log-prob head (``gather_hidden``).
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from slime_rl.trainer_megatron.attention import packed_seq_params


class LocalNorm:
    """torch's RMSNorm or LayerNorm (as ``WrappedTorchNorm`` builds them, state dict and all) whose
    weights say ``sequence_parallel`` when the config does; built by megatron's ``build_module``."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused):
        if config.normalization == "RMSNorm":
            norm: torch.nn.Module = torch.nn.RMSNorm(hidden_size, eps=eps)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        else:
            raise ValueError(f"normalization {config.normalization!r}: the local norms are RMSNorm and LayerNorm")
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def with_local_norms(layer_specs: list, config) -> TransformerBlockSubmodules:
    """The decoder block's spec: this stage's ``layer_specs`` with each of megatron's torch norms (input,
    pre-MLP and, where the model has them, q/k) a ``LocalNorm``, and a ``LocalNorm`` as the final norm."""
    converted = {}  # one converted spec per distinct spec (dense and MoE layers differ)
    for spec in layer_specs:
        if id(spec) not in converted:
            converted[id(spec)] = _with_local_norms_in_layer(spec)
    return TransformerBlockSubmodules(layer_specs=[converted[id(spec)] for spec in layer_specs], layer_norm=LocalNorm)


def _with_local_norms_in_layer(layer_spec):
    layer = _local_norms_in(layer_spec.submodules)
    attention = layer.self_attention
    if attention.submodules is not None:  # MLA (mla.py) builds its own latent norms, tagged for SP
        layer = dataclasses.replace(layer, self_attention=dataclasses.replace(
            attention, submodules=_local_norms_in(attention.submodules)))
    return dataclasses.replace(layer_spec, submodules=layer)


def _local_norms_in(submodules):
    """``submodules`` (a spec's dataclass) with every ``WrappedTorchNorm`` field a ``LocalNorm``."""
    norms = {f.name: LocalNorm for f in dataclasses.fields(submodules)
             if getattr(submodules, f.name) is WrappedTorchNorm}
    return dataclasses.replace(submodules, **norms)


def check_supported(*, tp: int, cp: int, lora: bool) -> None:
    """Refuse what SP does not cover yet, naming the field and the fix."""
    if tp > 1 and cp > 1:
        raise ValueError("parallel.sequence_parallel: not supported together with parallel.context_parallel_size > 1"
                         " yet; set sequence_parallel to false or context_parallel_size to 1")
    if tp > 1 and lora:
        raise ValueError("parallel.sequence_parallel: LoRA adapters see the linears' sequence-split inputs; set"
                         " sequence_parallel to false with trainer.lora")


def pad_micro_batch(mb, tp: int, tp_rank: int):
    """``mb`` with its sequence padded to a multiple of ``tp`` tokens: padded micro-batches get more
    columns, packed ones one more (padding) sequence. Padding comes after every real token, so the
    rows that predict the targets stay where they were. Routed experts (replay) pad to 0..k-1 and keep
    the tokens of TP rank ``tp_rank``'s part of the sequence: the ones its routers see."""
    rows, length = mb.input_ids.shape
    extra = -length % tp
    input_ids, packed, routed = mb.input_ids, mb.packed, mb.routed_experts
    if extra:
        input_ids = torch.nn.functional.pad(input_ids, (0, extra))
        if packed is not None:
            packed = packed_seq_params([*packed.seq_lens, extra])
    if routed is not None:  # [s * b, layers, k] (s-major) or [t, layers, k]: new tokens go last either way
        k = routed.shape[-1]
        pad = torch.arange(k, dtype=routed.dtype).expand(extra * rows, routed.shape[1], k)
        routed = torch.cat([routed, pad]).chunk(tp)[tp_rank]
    mine = (length + extra) * rows // tp  # this rank's tokens, of which the padding for TP comes last
    real = min(max(length * rows - tp_rank * mine, 0), mine)
    return dataclasses.replace(mb, input_ids=input_ids, packed=packed, routed_experts=routed, sp_real_tokens=real)


def gather_hidden(hidden: torch.Tensor) -> torch.Tensor:
    """The last stage's ``[s / TP, b, h]`` -> the whole ``[s, b, h]`` on every TP rank. Backward keeps
    this rank's part of the gradient: the log-prob head already sums its gradient over TP."""
    return tensor_parallel.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
