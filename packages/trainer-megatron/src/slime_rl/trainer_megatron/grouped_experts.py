"""All local experts of an MoE layer in one grouped GEMM per projection (``torch._grouped_mm``).

Megatron's own grouped experts need TransformerEngine (TEGroupedMLP) or the ``grouped_gemm``
package (GroupedMLP); without them the local spec runs SequentialMLP, one small GEMM per expert,
per layer and direction. ``GroupedExperts`` takes SequentialMLP's place in the layer spec
(``experts`` submodule of the MoE layer) with the same contract: the token dispatcher hands it the
tokens sorted by local expert, the count per expert and each token's routing weight, and it returns
the weighted expert outputs. Its weights are SequentialMLP's, stacked:

- ``fc1_weight`` ``[local experts, 2 * ffn / ETP, hidden]``: each expert's ``linear_fc1.weight``
  (``[gate_r; up_r]``, column-parallel over expert-TP ranks);
- ``fc2_weight`` ``[local experts, hidden, ffn / ETP]``: each expert's ``linear_fc2.weight``
  (row-parallel; the dispatcher reduces the partial sums over expert-TP ranks, as for SequentialMLP).

Checkpoints use SequentialMLP's sharded keys and global layout (``experts.linear_fc1.weight``,
``[experts, 2 * ffn, hidden]``), so the two read each other's checkpoints and reshard over EP/ETP.

``torch._grouped_mm`` runs CUTLASS's grouped GEMM on sm90+ in bf16 (torch's per-group loop for
other dtypes and devices). It needs every row stride to be a multiple of 16 bytes and, on CUDA,
16-byte-aligned data pointers; where those do not hold, where this torch has no ``_grouped_mm`` or
cannot run it for this device and dtype, and when no token reached this rank's experts (its
backward cannot contract over zero tokens), the layer loops over the experts as SequentialMLP does.
"""

from __future__ import annotations

import functools
import re
import warnings

import torch
import torch.nn.functional as F
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import make_sharded_object_for_checkpoint

_EXTRA_STATE = "expert{e}.{linear}._extra_state"  # state-dict key of a SequentialMLP extra state (below)
_EXTRA_STATE_KEY = re.compile(r"^expert\d+\.linear_fc[12]\._extra_state$")


class GroupedExperts(MegatronModule):
    """The local experts of one MoE layer, computed with grouped GEMMs (module docstring)."""

    def __init__(self, num_local_experts: int, config, pg_collection=None, name: str | None = None,
                 submodules=None):
        super().__init__(config=config)
        if not config.gated_linear_unit or config.activation_func is not F.silu or config.add_bias_linear:
            raise ValueError("model.path: the grouped experts implement SwiGLU experts without biases only;"
                             " set trainer.megatron.moe_grouped_gemm=false for other expert MLPs")
        self.num_local_experts = num_local_experts
        self.ep_group = pg_collection.ep
        self.tp_group = pg_collection.expt_tp  # expert-TP: fc1 column-parallel, fc2 row-parallel
        self.dp_group = pg_collection.expt_dp
        ffn = config.moe_ffn_hidden_size // self.tp_group.size()
        device = torch.device("cpu") if config.use_cpu_initialization else torch.cuda.current_device()
        self.fc1_weight = torch.nn.Parameter(torch.empty(num_local_experts, 2 * ffn, config.hidden_size,
                                                         dtype=config.params_dtype, device=device))
        self.fc2_weight = torch.nn.Parameter(torch.empty(num_local_experts, config.hidden_size, ffn,
                                                         dtype=config.params_dtype, device=device))
        if config.perform_initialization:
            for e in range(num_local_experts):
                config.init_method(self.fc1_weight.data[e])
                config.output_layer_init_method(self.fc2_weight.data[e])
        expert_parallel = config.expert_model_parallel_size > 1
        for weight, split_dim in ((self.fc1_weight, 1), (self.fc2_weight, 2)):
            # As SequentialMLP's linear layers: split over expert-TP ranks, and (under EP) reduced
            # over the expert-data-parallel group instead of the data-parallel one.
            set_tensor_model_parallel_attributes(weight, True, split_dim, 1)
            weight.allreduce = not expert_parallel

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor, **expert_buffers):
        """Tokens ``[T, hidden]`` sorted by local expert, ``tokens_per_expert`` ``[local experts]``,
        routing weights ``[T]`` -> (weighted expert outputs ``[T, hidden]``, None)."""
        if any(buffer is not None for buffer in expert_buffers.values()):
            raise NotImplementedError(f"GroupedExperts does not write into dispatcher buffers ({sorted(expert_buffers)})")
        hidden, probs = permuted_local_hidden_states, permuted_probs
        if self.config.moe_apply_probs_on_input:  # as SequentialMLP: weigh the input, not the output
            assert self.config.moe_router_topk == 1, "`moe_apply_probs_on_input` only works with `moe_router_topk`=1."
            hidden = (probs.unsqueeze(-1) * hidden).to(hidden.dtype)
            probs = torch.ones_like(probs)
        if tokens_per_expert.device.type == "cpu" and int(tokens_per_expert.sum()) != hidden.shape[0]:
            raise ValueError(f"GroupedExperts: {int(tokens_per_expert.sum())} tokens counted for"
                             f" {hidden.shape[0]} dispatched")
        if _grouped_mm_fits(hidden, self.fc1_weight, self.fc2_weight):
            # Counts from megatron's dispatcher are in pinned host memory (moe.LocalDispatcher's on the
            # device): sent as they are, without waiting; a cumsum on the host first would be pageable
            # memory, whose copy to the GPU syncs the stream once per layer.
            counts = tokens_per_expert.to(hidden.device, non_blocking=True)
            ends = torch.cumsum(counts, 0, dtype=torch.int32)
            fc1 = _grouped_linear(hidden.contiguous(), self.fc1_weight, ends)
            return _grouped_linear(self._activation(fc1, probs), self.fc2_weight, ends), None
        if hidden.device.type == "cuda" and hidden.shape[0]:
            _warn_per_expert_loop(hidden.dtype, hidden.shape[-1], self.fc2_weight.shape[-1])
        counts = tokens_per_expert.tolist()
        outputs = [F.linear(self._activation(F.linear(tokens, self.fc1_weight[e]), weights), self.fc2_weight[e])
                   for e, (tokens, weights) in enumerate(zip(torch.split(hidden, counts), torch.split(probs, counts),
                                                             strict=True))]
        return torch.cat(outputs, dim=0), None

    def _activation(self, fc1: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """SwiGLU times each token's routing weight, as Megatron's MLP computes it for an expert."""
        if self.config.bias_activation_fusion:
            from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl

            return weighted_bias_swiglu_impl(fc1, None, probs.unsqueeze(-1),
                                             self.config.activation_func_fp8_input_store)
        gate, linear = torch.chunk(fc1, 2, dim=-1)
        clamp = getattr(self.config, "activation_func_clamp_value", None)
        if clamp is not None:
            gate, linear = gate.clamp(min=None, max=clamp), linear.clamp(min=-clamp, max=clamp)
        out = F.silu(gate) * (linear + getattr(self.config, "glu_linear_offset", 0.0))
        return (out * probs.unsqueeze(-1)).to(fc1.dtype)

    def backward_dw(self) -> None:
        """Weight gradients are computed in the backward itself (MoELayer calls this for delayed wgrad)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """SequentialMLP's checkpoint keys and global shapes: ``[experts, 2 * ffn, hidden]`` for fc1
        (gate rows, then up rows: each expert-TP rank's gate and up halves land apart) and
        ``[experts, hidden, ffn]`` for fc2; replicated over the expert-data-parallel ranks."""
        axis = len(sharded_offsets)  # the layer axis (if any) comes first
        experts = (axis, self.ep_group.rank(), self.ep_group.size())
        etp_rank, etp_size = self.tp_group.rank(), self.tp_group.size()
        replica_id = (0, 0, self.dp_group.rank())

        def fc1_halves(key, t, replica_id, flattened_range):
            gate, up = torch.chunk(t, 2, dim=1)
            return [ShardedTensor.from_rank_offsets(key, half.contiguous(), *sharded_offsets, experts,
                                                    (axis + 1, part * etp_size + etp_rank, 2 * etp_size),
                                                    replica_id=replica_id, prepend_axis_num=axis)
                    for part, half in enumerate((gate, up))]

        def fc1_join(halves):
            return torch.cat(halves, dim=1)

        fc1 = ShardedTensorFactory(f"{prefix}experts.linear_fc1.weight", self.fc1_weight, fc1_halves, fc1_join,
                                   replica_id)
        fc2 = ShardedTensor.from_rank_offsets(f"{prefix}experts.linear_fc2.weight", self.fc2_weight,
                                              *sharded_offsets, experts, (axis + 2, etp_rank, etp_size),
                                              replica_id=replica_id, prepend_axis_num=axis)
        state = {f"{prefix}fc1_weight": fc1, f"{prefix}fc2_weight": fc2}
        # SequentialMLP's linear layers also save an (empty) extra state per expert, and ask for it
        # when they load: written here too, so that a grouped checkpoint resumes SequentialMLP.
        num_experts = self.ep_group.size() * self.num_local_experts
        for e in range(self.ep_group.rank() * self.num_local_experts,
                       (self.ep_group.rank() + 1) * self.num_local_experts):
            for linear in ("linear_fc1", "linear_fc2"):
                state[f"{prefix}{_EXTRA_STATE.format(e=e, linear=linear)}"] = make_sharded_object_for_checkpoint(
                    None, f"{prefix}experts.{linear}._extra_state", (*sharded_offsets, (axis, e, num_experts)),
                    (0, etp_rank, self.dp_group.rank()))
        return state

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        for key in [k for k in state_dict if k.startswith(prefix) and _EXTRA_STATE_KEY.match(k[len(prefix):])]:
            state_dict.pop(key)  # SequentialMLP's extra states (above): nothing to restore
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)


def _grouped_linear(x: torch.Tensor, stacked_weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``x[rows of expert e] @ stacked_weight[e].T`` for every expert, in one call; ``ends`` holds
    each expert's last row + 1 (int32, on x's device). The weights' transpose is a column-major
    view, the layout CUTLASS's kernel takes as it is."""
    out = torch._grouped_mm(x, stacked_weight.transpose(1, 2), offs=ends)
    if out.requires_grad:
        # _grouped_mm's backward refuses gradients with zero strides (an expanded ones_like, say)
        out.register_hook(torch.Tensor.contiguous)
    return out


def _grouped_mm_fits(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether torch._grouped_mm takes these operands: a working kernel for the device and dtype,
    rows a multiple of 16 bytes, 16-byte-aligned data on CUDA, and at least one token."""
    if x.shape[0] == 0 or not _grouped_mm_works(str(x.device), x.dtype):
        return False
    if any(t.shape[-1] * t.element_size() % 16 for t in (x, *weights)):
        return False  # x: hidden; fc1: hidden; fc2: ffn (and 2 * ffn, hidden for the outputs)
    return x.device.type != "cuda" or all(t.data_ptr() % 16 == 0 for t in (x, *weights))


@functools.cache
def _grouped_mm_works(device: str, dtype: torch.dtype) -> bool:
    """One tiny grouped GEMM, forward and backward, on ``device`` in ``dtype``: torch versions
    differ in which devices and dtypes _grouped_mm serves. Small exact values (the global RNG is
    left alone); grad mode forced on, since the first call may come from a no-grad log-prob pass."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    with torch.inference_mode(False), torch.enable_grad():
        x = ((torch.arange(6 * 16) % 7 - 3) / 4).reshape(6, 16).to(device, dtype).requires_grad_()
        w = ((torch.arange(2 * 16 * 16) % 5 - 2) / 4).reshape(2, 16, 16).to(device, dtype).requires_grad_()
        try:
            out = torch._grouped_mm(x, w.transpose(1, 2), offs=torch.tensor([2, 6], device=device, dtype=torch.int32))
            out.backward(torch.ones_like(out))
        except (RuntimeError, NotImplementedError):
            return False
    expected = torch.cat([x[:2] @ w[0].T, x[2:] @ w[1].T]).detach()
    return bool(torch.allclose(out.detach().float(), expected.float(), rtol=2e-2, atol=2e-2))


@functools.cache
def _warn_per_expert_loop(dtype: torch.dtype, hidden: int, ffn: int) -> None:
    """Once per dtype and shape: on CUDA the per-expert loop is the slow path, say why it runs."""
    warnings.warn(f"MoE experts: torch._grouped_mm cannot take these operands ({dtype}, hidden {hidden}, expert ffn"
                  f" per rank {ffn}: it needs rows of a multiple of 16 bytes, 16-byte-aligned data and a torch that"
                  " runs it on this GPU); looping over the experts, one GEMM each", stacklevel=3)


def grouped_mm_available() -> bool:
    """Whether this torch has ``torch._grouped_mm`` at all (``slime-cli doctor``)."""
    return hasattr(torch, "_grouped_mm")
