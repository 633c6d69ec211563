"""LoRA adapters on Megatron's tensor-parallel projections (``trainer.lora``; names and merge in core/lora.py).

Each targeted linear gets a sibling module ``<linear>_lora`` (``linear_qkv_lora`` beside ``linear_qkv``)
and a forward hook on the linear that adds the adapter's output to the linear's, so the base
weights keep their names (HF conversion, checkpoints) and only the adapters train.

Sharding follows the wrapped layer:
- column-parallel (``linear_qkv``, ``linear_fc1``): A ``[r, in]`` replicated, B ``[out / tp, r]`` split
  on its rows exactly as the weight is (qkv groups, [gate; up]); ``A x`` enters the TP region through
  ``copy_to_tensor_model_parallel_region`` so A's gradient is summed over the TP ranks.
- row-parallel (``linear_proj``, ``linear_fc2``): A ``[r, in / tp]`` split on its columns, its partial
  product all-reduced over TP before the replicated B ``[out, r]``.
A fused layer has one A shared by its HF modules and B split by rows, so it exports as exact
per-module PEFT adapters (q/k/v and gate/up with the same A). When only some of a fused layer's
modules are targeted, the rows of the others are held at zero by a fixed mask.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from safetensors.torch import save_file

from slime_rl.core.algorithms.lora import LoraSpec, merged, peft_adapter_config, peft_name
from slime_rl.trainer_megatron import convert
from slime_rl.trainer_megatron.model import HFModelShape, PolicyGPT


@dataclass(frozen=True)
class Projection:
    """One Megatron linear that can carry an adapter, and the HF modules it fuses."""

    path: str  # inside a layer, e.g. "self_attention.linear_qkv"
    hf_modules: tuple[str, ...]  # HF module names inside model.layers.{i}
    split: int | str  # the weight's TP split (convert.ParamRef.split)

    @property
    def column(self) -> bool:
        return self.split != 1


PROJECTIONS = (
    Projection("self_attention.linear_qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "qkv"),
    Projection("self_attention.linear_proj", ("self_attn.o_proj",), 1),
    Projection("mlp.linear_fc1", ("mlp.gate_proj", "mlp.up_proj"), "glu"),
    Projection("mlp.linear_fc2", ("mlp.down_proj",), 1),
)


class LoraAdapter(torch.nn.Module):
    """``scaling * B (A dropout(x))`` beside one TP-sharded linear; see the module docstring."""

    def __init__(self, proj: Projection, spec: LoraSpec, shape: HFModelShape, layer: int, seed: int,
                 dtype: torch.dtype):
        super().__init__()
        self.proj, self.scaling, self.enabled, self._shape = proj, spec.scaling, True, shape
        self.dropout = torch.nn.Dropout(spec.dropout) if spec.dropout > 0 else None
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        in_full, out_full = _full_shape(proj, shape)
        # A as PEFT initialises it (kaiming-uniform, a=sqrt(5)), drawn whole from a generator of the
        # trainer seed and the layer, then sliced: every TP/PP layout starts from the same adapters.
        g = torch.Generator().manual_seed(seed * 1_000_003 + layer * len(PROJECTIONS) + PROJECTIONS.index(proj))
        a_full = torch.empty(spec.rank, in_full)
        torch.nn.init.kaiming_uniform_(a_full, a=math.sqrt(5), generator=g)
        a_ref, b_ref = self._refs()
        self.lora_A = torch.nn.Parameter(convert.shard(a_ref, a_full, tp_rank, tp_size).to(dtype).contiguous())
        self.lora_B = torch.nn.Parameter(torch.zeros(out_full // tp_size if proj.column else out_full, spec.rank,
                                                     dtype=dtype))
        if proj.column:
            tensor_parallel.set_tensor_model_parallel_attributes(self.lora_B, True, 0, 1)
        else:
            tensor_parallel.set_tensor_model_parallel_attributes(self.lora_A, True, 1, 1)
        targeted = [m.rsplit(".", 1)[1] in spec.target_modules for m in proj.hf_modules]
        mask = None
        if not all(targeted):  # a fused layer, partly targeted: the others' rows of B stay zero
            rows = [torch.full((n,), float(t)) for n, t in zip(_hf_rows(proj, shape), targeted, strict=True)]
            mask = convert.shard(b_ref, convert.hf_to_full(b_ref, rows, shape), tp_rank, tp_size).to(dtype)[:, None]
        self.register_buffer("row_mask", mask, persistent=False)
        self.targeted = tuple(m for m, t in zip(proj.hf_modules, targeted, strict=True) if t)

    def _refs(self) -> tuple[convert.ParamRef, convert.ParamRef]:
        """How A and B are split over TP and fused, as convert's ParamRefs (names unused)."""
        if self.proj.column:
            return convert.ParamRef("A", (), None, None), convert.ParamRef("B", (), self.proj.split, None)
        return convert.ParamRef("A", (), 1, None), convert.ParamRef("B", (), None, None)

    def b_weight(self) -> torch.Tensor:
        return self.lora_B if self.row_mask is None else self.lora_B * self.row_mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dropout is not None:
            if self.proj.column:  # x is the same on every TP rank: so is its mask (the default RNG)
                x = self.dropout(x)
            else:  # x is this rank's slice: the model-parallel RNG gives each slice its own mask
                with tensor_parallel.get_cuda_rng_tracker().fork():
                    x = self.dropout(x)
        low = torch.nn.functional.linear(x, self.lora_A)
        if self.proj.column:
            low = tensor_parallel.copy_to_tensor_model_parallel_region(low)
        else:
            low = tensor_parallel.reduce_from_tensor_model_parallel_region(low)
        return torch.nn.functional.linear(low, self.b_weight()) * self.scaling

    def hook(self, module: torch.nn.Module, args: tuple, output: tuple) -> tuple:
        """The wrapped linear's forward hook: its output plus the adapter's (a no-op when disabled)."""
        if not self.enabled:
            return output
        out, bias = output
        return out + self(args[0]).to(out.dtype), bias

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Megatron's sharded checkpoint entries: split like the layer, so a resume on another TP reshards."""
        state = self.state_dict(prefix="", keep_vars=True)
        axis = {"lora_B": 0} if self.proj.column else {"lora_A": 1}
        out = make_sharded_tensors_for_checkpoint(state, prefix, axis, sharded_offsets)
        if self.proj.split == "glu":  # [gate_r; up_r] per rank: two tensors, each split on rows
            out[f"{prefix}lora_B"] = apply_swiglu_sharded_factory(out[f"{prefix}lora_B"], sharded_offsets)
        return out

    @torch.no_grad()
    def full_tensors(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The targeted HF modules' (A, B), whole (gathered over TP; collective over this rank's TP group)."""
        a_ref, b_ref = self._refs()
        a, b = _gather(a_ref, self.lora_A.detach()), _gather(b_ref, self.b_weight().detach())
        b_parts = convert.full_to_hf(b_ref, b, self._shape)
        # each module its own A (a copy): a bucket or a file never holds two names for one storage
        return {m: (a.clone(), b_part) for m, b_part in zip(self.proj.hf_modules, b_parts, strict=True)
                if m in self.targeted}


def _gather(ref: convert.ParamRef, local: torch.Tensor) -> torch.Tensor:
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    if ref.split is None or tp_size == 1:
        return local.clone()
    shards = [torch.empty_like(local) for _ in range(tp_size)]
    dist.all_gather(shards, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return convert.unshard(ref, shards)


def _hf_rows(proj: Projection, shape: HFModelShape) -> list[int]:
    """The output rows of each HF module of ``proj``."""
    heads = {"self_attn.q_proj": shape.num_heads, "self_attn.k_proj": shape.num_kv_heads,
             "self_attn.v_proj": shape.num_kv_heads}
    return [heads[m] * shape.head_dim if m in heads else shape.intermediate_size for m in proj.hf_modules]


def _full_shape(proj: Projection, shape: HFModelShape) -> tuple[int, int]:
    """(in, out) of the whole (unsharded) linear."""
    attn = shape.num_heads * shape.head_dim
    ins = {"self_attention.linear_qkv": shape.hidden_size, "self_attention.linear_proj": attn,
           "mlp.linear_fc1": shape.hidden_size, "mlp.linear_fc2": shape.intermediate_size}
    return ins[proj.path], sum(_hf_rows(proj, shape)) if proj.column else shape.hidden_size


def check_supported(spec: LoraSpec, shape: HFModelShape, role: str) -> None:
    """Refuse what the adapters do not cover, naming the config field."""
    if shape.moe is not None:
        raise ValueError(f"trainer.lora: adapters on mixture-of-experts layers are not supported ({shape.architecture});"
                         " set trainer.lora.rank=0 to train the full model")
    if role != "actor":
        raise ValueError("trainer.lora: the PPO critic trains its full model; LoRA is for the actor only"
                         " (use a critic-free estimator such as grpo, or trainer.lora.rank=0)")


def attach(model: PolicyGPT, spec: LoraSpec, shape: HFModelShape, seed: int) -> list[tuple[int, LoraAdapter]]:
    """Adapters on this stage's targeted projections, every other parameter frozen; (global layer, adapter)."""
    for param in model.parameters():
        param.requires_grad_(False)
    dtype = model.config.params_dtype
    offset = convert.layer_offset(model)
    adapters = []
    for local, layer in enumerate(model.decoder.layers):
        for proj in PROJECTIONS:
            if not any(m.rsplit(".", 1)[1] in spec.target_modules for m in proj.hf_modules):
                continue
            parent_path, name = proj.path.rsplit(".", 1)
            parent = layer.get_submodule(parent_path)
            adapter = LoraAdapter(proj, spec, shape, offset + local, seed, dtype)
            parent.add_module(name + convert.ADAPTER_SUFFIX, adapter)
            getattr(parent, name).register_forward_hook(adapter.hook)
            adapters.append((offset + local, adapter))
    return adapters


class Adapters:
    """This rank's adapters: the reference switch (adapters off), the export and the merge."""

    def __init__(self, model: PolicyGPT, spec: LoraSpec, shape: HFModelShape, seed: int):
        self.model, self.spec, self.shape = model, spec, shape
        self.layers = attach(model, spec, shape, seed)
        if model.pre_process:
            # The frozen embedding's output needs no gradient, and a recomputed (checkpointed) block whose
            # inputs need none is never run backward: its adapters would get no gradient. Ask for one.
            model.embedding.register_forward_hook(lambda module, args, out: out.requires_grad_(True))

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The reference policy: the base with every adapter off (the ``ReferenceWeights`` interface)."""
        for _, adapter in self.layers:
            adapter.enabled = False
        try:
            yield
        finally:
            for _, adapter in self.layers:
                adapter.enabled = True

    @torch.no_grad()
    def hf_tensors(self) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        """(HF weight name, A, B) of every adapter of the whole model, identical on every rank, in layer
        order. Collective over the TP and PP groups."""
        pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        mine = {(layer, a.proj.path): a for layer, a in self.layers}
        device = next(self.model.parameters()).device
        per_stage = self.shape.num_layers // pp_size
        for layer in range(self.shape.num_layers):
            for proj in PROJECTIONS:
                modules = [m for m in proj.hf_modules if m.rsplit(".", 1)[1] in self.spec.target_modules]
                if not modules:
                    continue
                owner = layer // per_stage
                if owner == pp_rank:
                    pairs = mine[(layer, proj.path)].full_tensors()
                else:
                    pairs = {m: self._empty_pair(proj, m, device) for m in modules}
                for module in modules:
                    a, b = pairs[module]
                    if pp_size > 1:
                        src = dist.get_process_group_ranks(pp_group)[owner]
                        dist.broadcast(a, src=src, group=pp_group)
                        dist.broadcast(b, src=src, group=pp_group)
                    yield f"model.layers.{layer}.{module}.weight", a, b

    def _empty_pair(self, proj: Projection, module: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        in_full, out_full = _full_shape(proj, self.shape)
        rows = dict(zip(proj.hf_modules, _hf_rows(proj, self.shape), strict=True))[module] if proj.column else out_full
        dtype = self.model.config.params_dtype
        return (torch.empty(self.spec.rank, in_full, dtype=dtype, device=device),
                torch.empty(rows, self.spec.rank, dtype=dtype, device=device))

    def peft_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The adapters under PEFT names (``...q_proj.lora_A.weight``), full tensors. Collective."""
        for name, a, b in self.hf_tensors():
            yield peft_name(name, "A"), a
            yield peft_name(name, "B"), b

    def merged_hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The full HF weights with the adapters merged in (``W + scaling * B A``). Collective."""
        pairs = {name: (a, b) for name, a, b in self.hf_tensors()}  # small: gathered first, same order everywhere
        for name, weight in convert.iter_hf_tensors(self.model, self.shape):
            if name in pairs:
                weight = merged(weight, *pairs[name], self.spec.scaling)
            yield name, weight

    def save_peft(self, folder: str, base_model: str) -> None:
        """A PEFT LoRA folder: ``adapter_config.json`` and ``adapter_model.safetensors`` (collective; rank 0
        writes), loadable with ``peft.PeftModel.from_pretrained(base, folder)``."""
        tensors = {name: t.to("cpu").contiguous() for name, t in self.peft_tensors()}
        if dist.get_rank() == 0:
            out = Path(folder)
            out.mkdir(parents=True, exist_ok=True)
            save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
            config = peft_adapter_config(self.spec, base_model)
            (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
        dist.barrier()
