"""Hugging Face <-> Megatron weights: names, fused QKV and gate/up, TP/PP sharding.

Loading: every rank reads only the HF tensors of its pipeline stage and copies its
tensor-parallel slice into the model. Exporting: the owner stage gathers TP slices,
splits fused tensors back into HF ones, and broadcasts them over the pipeline group,
so every rank yields the same full, HF-named tensors.

Megatron layouts (local spec):
- ``linear_qkv``: per query group ``g``: ``[q heads of g, k_g, v_g]`` stacked on dim 0;
  TP ranks hold contiguous runs of groups.
- ``linear_fc1``: ``[gate; up]`` on dim 0; each TP rank holds ``[gate_r; up_r]``.
- ``linear_proj`` and ``linear_fc2`` are split on dim 1 (row parallel); embedding and
  output layer on dim 0 (vocab parallel); norms are replicated.
- MoE experts: each expert's ``linear_fc1``/``linear_fc2`` as above, over expert-TP ranks; the
  grouped experts stack them (``experts.fc1_weight`` ``[local experts, ...]``) and are read and
  written one expert view at a time, under SequentialMLP's per-expert names.
- GLM-4.5: the first ``first_k_dense_replace`` layers have a dense MLP, the rest the MoE layer; the
  router's ``e_score_correction_bias`` is megatron's ``router.expert_bias`` buffer (float32 whatever the
  model's dtype, as megatron-core and transformers keep it); the shared experts are ``shared_experts``.
  Multi-token-prediction layers (``model.layers.{num_hidden_layers + i}``) are not built: they are
  neither trained nor synced to engines (which keep the checkpoint's), and `save_hf` copies them
  unchanged from the source folder, so a saved folder holds every tensor the checkpoint had.
- DeepSeek-V3 and V2 (the layers and MTP as GLM-4.5's): multi-head latent attention's projections and norms (mla.py) are
  HF's tensors one to one, unfused and unpermuted (``kv_b_proj`` stays whole: SGLang derives its ``w_kc``/``w_vc``
  from it after loading). Under TP, q_b_proj (V2-Lite's q_proj) and kv_b_proj split on dim 0 by heads as they are
  (each head's rows are contiguous), o_proj on dim 1; the down-projections and latent norms are replicated.
- Qwen2.5-VL and Qwen3-VL: the language model's tensors are Qwen2's and Qwen3's; the vision tower's ``visual.X``
  are the first stage's ``vision.X`` one to one, replicated over TP (vision.py); the checkpoint's prefixes are
  the checkpoint's own (``model.``/``visual.``, or ``model.language_model.``/``model.visual.`` as transformers
  4.52-4.57 saved Qwen2.5-VL and Qwen3-VL ships; vision.checkpoint_prefixes reads which).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from slime_rl.core.contracts import NamedTensors
from slime_rl.trainer_megatron import vlm
from slime_rl.trainer_megatron.mla import hf_tensor_shape
from slime_rl.trainer_megatron.model import HFModelShape, PolicyGPT
from slime_rl.trainer_megatron.vision import hf_tensor_shapes

ADAPTER_SUFFIX = "_lora"  # a LoRA adapter beside linear X is the module X_lora (lora.py)
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# Megatron suffix inside a layer -> (HF suffix inside model.layers.{i}, TP split)
# split: None = replicated, 0 = column (dim 0), 1 = row (dim 1), "qkv", "glu"
_LAYER_PARAMS = {
    "input_layernorm.weight": ("input_layernorm.weight", None),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight", None),
    "self_attention.linear_qkv.weight": ("self_attn.{q,k,v}_proj.weight", "qkv"),
    "self_attention.linear_qkv.bias": ("self_attn.{q,k,v}_proj.bias", "qkv"),
    "self_attention.q_layernorm.weight": ("self_attn.q_norm.weight", None),
    "self_attention.k_layernorm.weight": ("self_attn.k_norm.weight", None),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight", 1),
    "mlp.linear_fc1.weight": ("mlp.{gate,up}_proj.weight", "glu"),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight", 1),
}
# Multi-head latent attention (mla.py) in place of linear_qkv (and q/k norms); linear_proj is o_proj as above.
# V2-Lite (q_lora_rank null) has linear_q_proj (q_proj) instead of the q down-projection, norm and up-projection.
# q_a_proj right before kv_a_proj_with_mqa: SGLang fuses the two (see `bucketed`).
_MLA_PARAMS = {
    "self_attention.linear_q_proj.weight": ("self_attn.q_proj.weight", 0),
    "self_attention.linear_q_down_proj.weight": ("self_attn.q_a_proj.weight", None),
    "self_attention.linear_kv_down_proj.weight": ("self_attn.kv_a_proj_with_mqa.weight", None),
    "self_attention.q_layernorm.weight": ("self_attn.q_a_layernorm.weight", None),
    "self_attention.linear_q_up_proj.weight": ("self_attn.q_b_proj.weight", 0),
    "self_attention.kv_layernorm.weight": ("self_attn.kv_a_layernorm.weight", None),
    "self_attention.linear_kv_up_proj.weight": ("self_attn.kv_b_proj.weight", 0),
}
_QKV_ATTENTION = ("self_attention.linear_qkv.", "self_attention.q_layernorm.", "self_attention.k_layernorm.")
# MoE layers (moe.py): the router, each expert (split over expert-TP ranks, spread over EP ranks)
# and Qwen2-MoE's gated shared expert. "{e}" is the global expert index.
_MOE_PARAMS = {
    "mlp.router.weight": ("mlp.gate.weight", None),
    "mlp.router.expert_bias": ("mlp.gate.e_score_correction_bias", None),
    # "<shared>": the HF module, MoEShape.hf_shared_experts (Qwen2-MoE's shared_expert, GLM's shared_experts)
    "mlp.shared_experts.linear_fc1.weight": ("mlp.<shared>.{gate,up}_proj.weight", "glu"),
    "mlp.shared_experts.linear_fc2.weight": ("mlp.<shared>.down_proj.weight", 1),
    "mlp.shared_experts.gate_weight": ("mlp.shared_expert_gate.weight", None),
}
_EXPERT_PARAMS = {
    "mlp.experts.local_experts.{e}.linear_fc1.weight": ("mlp.experts.{e}.{gate,up}_proj.weight", "glu"),
    "mlp.experts.local_experts.{e}.linear_fc2.weight": ("mlp.experts.{e}.down_proj.weight", 1),
}
_LOCAL_EXPERT = re.compile(r"^(.*\.local_experts\.)(\d+)(\..+)$")
# GroupedExperts (grouped_experts.py) stacks each local expert's linear_fc1/linear_fc2 weight
_STACKED_EXPERTS = re.compile(r"^(.*\.mlp\.experts\.)(fc1|fc2)_weight$")
_EXPERT_BIAS = "mlp.router.expert_bias"  # a buffer, not a parameter: float32, frozen (moe.py)
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
logger = logging.getLogger(__name__)
_GLOBAL_PARAMS = {
    "embedding.word_embeddings.weight": ("model.embed_tokens.weight", 0),
    "decoder.final_layernorm.weight": ("model.norm.weight", None),
    "output_layer.weight": ("lm_head.weight", 0),
}


@dataclass(frozen=True)
class ParamRef:
    """One Megatron parameter in global terms."""

    megatron_name: str  # with the global layer index
    hf_names: tuple[str, ...]
    split: int | str | None
    layer: int | None  # global layer index, None for embedding / final norm / output layer
    expert: int | None = None  # global expert index: split over expert-TP ranks, held by one EP rank


def _expand(hf_suffix: str) -> tuple[str, ...]:
    m = re.search(r"\{(.+?)\}", hf_suffix)
    if not m:
        return (hf_suffix,)
    return tuple(hf_suffix.replace(m.group(0), part) for part in m.group(1).split(","))


def param_refs(shape: HFModelShape) -> list[ParamRef]:
    """Every Megatron parameter of the whole model (all stages), in HF order."""
    refs = [ParamRef("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), 0, None)]
    for i in range(shape.num_layers):
        for suffix, (hf_suffix, split) in _layer_params(shape).items():
            if suffix.endswith("linear_qkv.bias") and not shape.qkv_bias:
                continue
            if suffix.startswith(_QKV_ATTENTION[1:]) and not shape.qk_norm and shape.mla is None:  # MLA's q_a norm
                continue
            if suffix.startswith("mlp.") and shape.moe is not None and shape.moe.is_moe_layer(i):
                continue
            hf = tuple(f"model.layers.{i}.{name}" for name in _expand(hf_suffix))
            refs.append(ParamRef(f"decoder.layers.{i}.{suffix}", hf, split, i))
        if shape.moe is not None and shape.moe.is_moe_layer(i):
            refs += _moe_refs(shape, i)
    refs.append(ParamRef("decoder.final_layernorm.weight", ("model.norm.weight",), None, None))
    if not shape.tie_word_embeddings:
        refs.append(ParamRef("output_layer.weight", ("lm_head.weight",), 0, None))
    if shape.vision is not None:  # the vision tower (vision.py), then every name as the VL checkpoint has it
        refs += [ParamRef("vision." + name.removeprefix("visual."), (name,), None, None)
                 for name in hf_tensor_shapes(shape.vision)]
        refs = [dataclasses.replace(r, hf_names=tuple(vlm.hf_name(shape, n) for n in r.hf_names)) for r in refs]
    return refs


def _layer_params(shape: HFModelShape) -> dict[str, tuple[str, int | str | None]]:
    """A layer's attention, norms and dense MLP: q/k/v attention's, or MLA's with V2-Lite's q_proj or V3's q
    down- and up-projections."""
    if shape.mla is None:
        return _LAYER_PARAMS
    low_rank_q = ("linear_q_down_proj", "q_layernorm", "linear_q_up_proj")
    unused = low_rank_q if shape.mla.q_lora_rank is None else ("linear_q_proj",)
    mla = {suffix: hf for suffix, hf in _MLA_PARAMS.items() if suffix.split(".")[1] not in unused}
    layer = {suffix: hf for suffix, hf in _LAYER_PARAMS.items() if not suffix.startswith(_QKV_ATTENTION)}
    return {**mla, **layer}


def _moe_refs(shape: HFModelShape, i: int) -> list[ParamRef]:
    refs = []
    moe = shape.moe
    for suffix, (hf_suffix, split) in _MOE_PARAMS.items():
        hf_suffix = hf_suffix.replace("<shared>", moe.hf_shared_experts)
        if "shared_expert" in hf_suffix and moe.shared_expert_intermediate_size is None:
            continue
        if suffix == "mlp.shared_experts.gate_weight" and not moe.shared_expert_gate:
            continue
        if suffix == _EXPERT_BIAS and not moe.expert_bias:
            continue
        hf = tuple(f"model.layers.{i}.{name}" for name in _expand(hf_suffix))
        refs.append(ParamRef(f"decoder.layers.{i}.{suffix}", hf, split, i))
    for e in range(shape.moe.num_experts):
        for suffix, (hf_suffix, split) in _EXPERT_PARAMS.items():
            hf = tuple(f"model.layers.{i}.{name}" for name in _expand(hf_suffix.replace("{e}", str(e))))
            refs.append(ParamRef(f"decoder.layers.{i}.{suffix.replace('{e}', str(e))}", hf, split, i, e))
    return refs


def _expert_layout() -> tuple[int, int, int, int]:
    """(EP rank, EP size, expert-TP rank, expert-TP size) of this rank."""
    return (parallel_state.get_expert_model_parallel_rank(), parallel_state.get_expert_model_parallel_world_size(),
            parallel_state.get_expert_tensor_parallel_rank(), parallel_state.get_expert_tensor_parallel_world_size())


def _split_layout(ref: ParamRef) -> tuple[int, int]:
    """(rank, size) over which ``ref`` is split: expert-TP for experts, TP for the rest."""
    if ref.expert is not None:
        _, _, etp_rank, etp_size = _expert_layout()
        return etp_rank, etp_size
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


# ---------------------------------------------------------------- fusing and splitting


def hf_to_full(ref: ParamRef, tensors: list[torch.Tensor], shape: HFModelShape) -> torch.Tensor:
    """HF tensors -> the full (unsharded) Megatron tensor."""
    if ref.split == "qkv":
        q, k, v = tensors
        groups, d = shape.num_kv_heads, shape.head_dim
        rest = q.shape[1:]
        q = q.reshape(groups, -1, *rest)
        k = k.reshape(groups, d, *rest)
        v = v.reshape(groups, d, *rest)
        return torch.cat([q, k, v], dim=1).reshape(-1, *rest)
    if ref.split == "glu":
        return torch.cat(tensors, dim=0)
    (t,) = tensors
    return t


def full_to_hf(ref: ParamRef, full: torch.Tensor, shape: HFModelShape) -> list[torch.Tensor]:
    if ref.split == "qkv":
        groups, d = shape.num_kv_heads, shape.head_dim
        per_group = shape.num_heads // groups
        rest = full.shape[1:]
        grouped = full.reshape(groups, (per_group + 2) * d, *rest)
        q, k, v = grouped.split([per_group * d, d, d], dim=1)
        return [x.reshape(-1, *rest).contiguous() for x in (q, k, v)]
    if ref.split == "glu":
        return [x.contiguous() for x in full.chunk(2, dim=0)]
    return [full]


def shard(ref: ParamRef, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's slice of a full Megatron tensor."""
    if ref.split is None or tp_size == 1:
        return full
    if ref.split == "glu":
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size, 0)[tp_rank], up.chunk(tp_size, 0)[tp_rank]], dim=0)
    dim = 0 if ref.split == "qkv" else ref.split
    return full.chunk(tp_size, dim)[tp_rank]


def unshard(ref: ParamRef, shards: list[torch.Tensor]) -> torch.Tensor:
    """The inverse of ``shard`` over all TP ranks' slices."""
    if ref.split is None or len(shards) == 1:
        return shards[0]
    if ref.split == "glu":
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    dim = 0 if ref.split == "qkv" else ref.split
    return torch.cat(shards, dim=dim)


# ---------------------------------------------------------------- local names


def is_adapter_param(name: str) -> bool:
    """Whether model parameter ``name`` belongs to a LoRA adapter (not an HF weight)."""
    return f"{ADAPTER_SUFFIX}." in name


def layer_offset(model: PolicyGPT) -> int:
    """Global index of this stage's first layer."""
    layers = model.decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0


def local_params(model: PolicyGPT, shape: HFModelShape) -> dict[str, tuple[ParamRef, torch.Tensor]]:
    """This rank's parameters keyed by local name, each with its global ParamRef; a stacked expert
    weight gives one view (of its storage) per local expert."""
    refs = {r.megatron_name: r for r in param_refs(shape)}
    offset = layer_offset(model)
    first_expert = 0
    if shape.moe is not None:
        ep_rank, ep_size, _, _ = _expert_layout()
        first_expert = ep_rank * (shape.moe.num_experts // ep_size)
    out = {}
    for name, param in _per_expert_parameters(model):
        if name.startswith("value_head.") or is_adapter_param(name):
            continue
        m = _LAYER.match(name)
        global_name = f"decoder.layers.{int(m.group(1)) + offset}.{m.group(2)}" if m else name
        if (e := _LOCAL_EXPERT.match(global_name)) is not None:  # local expert index -> global
            global_name = f"{e.group(1)}{int(e.group(2)) + first_expert}{e.group(3)}"
        if global_name == "output_layer.weight" and shape.tie_word_embeddings:
            # PP > 1 with tied embeddings: the last stage's copy of the embedding.
            ref = ParamRef("output_layer.weight", ("model.embed_tokens.weight",), 0, None)
        elif global_name not in refs:
            raise KeyError(f"Megatron parameter {name} has no Hugging Face counterpart")
        else:
            ref = refs[global_name]
        out[name] = (ref, param)
    return out


def checkpoint_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of this rank's model that a checkpoint sets: its parameters, then the routers'
    expert-bias buffers (GLM's ``e_score_correction_bias``: frozen, so not a parameter)."""
    yield from model.named_parameters()
    for name, buffer in model.named_buffers():
        if name.endswith(_EXPERT_BIAS):
            yield name, buffer


def _per_expert_parameters(model: PolicyGPT) -> Iterator[tuple[str, torch.Tensor]]:
    """`checkpoint_tensors` with GroupedExperts' stacked weights as one view per local
    expert, named as SequentialMLP names that expert's weight (``...experts.local_experts.{j}.
    linear_fc1.weight``): what the HF mapping reads and writes, one expert at a time."""
    for name, param in checkpoint_tensors(model):
        m = _STACKED_EXPERTS.match(name)
        if m is None:
            yield name, param
            continue
        for j, expert in enumerate(param.detach().unbind(0)):
            yield f"{m.group(1)}local_experts.{j}.linear_{m.group(2)}.weight", expert


# ---------------------------------------------------------------- HF folder in


class SafetensorsFolder:
    """Read tensors by name from a HF folder (one file or an index of shards)."""

    def __init__(self, folder: str | Path):
        from safetensors import safe_open

        folder = Path(folder)
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (folder / "model.safetensors").is_file():
            with safe_open(folder / "model.safetensors", "pt") as f:
                weight_map = {k: "model.safetensors" for k in f.keys()}
        else:
            raise FileNotFoundError(f"model.path: {folder} has no model.safetensors or model.safetensors.index.json")
        self.folder = folder
        self.weight_map = weight_map
        self._open = {}
        self._safe_open = safe_open

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise KeyError(f"{self.folder}: tensor {name} is missing from the checkpoint")
        file = self.weight_map[name]
        if file not in self._open:
            self._open[file] = self._safe_open(self.folder / file, "pt")
        return self._open[file].get_tensor(name)


@torch.no_grad()
def load_hf(model: PolicyGPT, folder: str | Path, shape: HFModelShape) -> None:
    """Copy this rank's TP/PP slice of the HF weights in ``folder`` into ``model``."""
    reader = SafetensorsFolder(folder)
    for name, (ref, param) in local_params(model, shape).items():
        hf_names = ref.hf_names
        if ref.megatron_name == "output_layer.weight" and "lm_head.weight" not in reader:
            if not shape.tie_word_embeddings:
                raise KeyError(f"{folder}: lm_head.weight is missing and tie_word_embeddings is false")
        full = hf_to_full(ref, [reader.get(n) for n in hf_names], shape)
        local = shard(ref, full, *_split_layout(ref))
        if local.shape != param.shape:
            raise ValueError(f"{folder}: {hf_names} give shape {tuple(local.shape)} for {name}, expected {tuple(param.shape)}")
        if name.endswith(_EXPERT_BIAS):
            # float32 even in a bf16 model (whose cast made the buffer bf16): megatron-core routes with
            # it in float32, and a bf16 copy would move experts' scores by up to 2^-9
            param.data = local.to(param.device, torch.float32).clone()
            continue
        param.data.copy_(local)
    if (mtp := mtp_tensor_names(shape, reader.weight_map)) and dist.get_rank() == 0:
        logger.warning("%s: %d multi-token-prediction layer(s) (%d tensors, model.layers.%d.*) not loaded: the trainer"
                       " neither trains nor syncs them; save_hf copies them unchanged", folder, shape.mtp_layers,
                       len(mtp), shape.num_layers)


# ---------------------------------------------------------------- HF tensors out


def _stage_of(ref: ParamRef, shape: HFModelShape, pp_size: int) -> int:
    if ref.layer is not None:
        return ref.layer // (shape.num_layers // pp_size)
    return 0 if ref.megatron_name.startswith(("embedding", "vision.")) else pp_size - 1


def _dtype_of(model: PolicyGPT) -> torch.dtype:
    return next(model.parameters()).dtype


def _hf_shapes(ref: ParamRef, shape: HFModelShape) -> list[tuple[int, ...]]:
    """Full HF shapes of a ref's tensors (what non-owner stages allocate to receive)."""
    h, d = shape.hidden_size, shape.head_dim
    out = []
    moe = shape.moe
    for name in ref.hf_names:
        if shape.vision is not None and (canonical := vlm.canonical_name(shape, name)).startswith("visual."):
            out.append(hf_tensor_shapes(shape.vision)[canonical])
        elif shape.mla is not None and (mla := hf_tensor_shape(shape.mla, name, shape.num_heads, h)) is not None:
            out.append(mla)
        elif moe is not None and (".experts." in name or ".shared_expert." in name or ".shared_experts." in name):
            size = moe.expert_intermediate_size if ".experts." in name else moe.shared_expert_intermediate_size
            out.append((h, size) if name.endswith("down_proj.weight") else (size, h))
        elif name.endswith("mlp.gate.weight"):
            out.append((moe.num_experts, h))
        elif name.endswith("shared_expert_gate.weight"):
            out.append((1, h))
        elif name.endswith("e_score_correction_bias"):
            out.append((moe.num_experts,))
        elif name.endswith(("q_proj.weight",)):
            out.append((shape.num_heads * d, h))
        elif name.endswith(("k_proj.weight", "v_proj.weight")):
            out.append((shape.num_kv_heads * d, h))
        elif name.endswith("q_proj.bias"):
            out.append((shape.num_heads * d,))
        elif name.endswith(("k_proj.bias", "v_proj.bias")):
            out.append((shape.num_kv_heads * d,))
        elif name.endswith(("q_norm.weight", "k_norm.weight")):
            out.append((d,))
        elif name.endswith("o_proj.weight"):
            out.append((h, shape.num_heads * d))
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):
            out.append((shape.intermediate_size, h))
        elif name.endswith("down_proj.weight"):
            out.append((h, shape.intermediate_size))
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            out.append((shape.vocab_size, h))
        else:  # norms
            out.append((h,))
    return out


@torch.no_grad()
def iter_hf_tensors(model: PolicyGPT, shape: HFModelShape) -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF-named tensors, identical on every rank. Collective over TP and PP groups."""
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    pp_ranks = dist.get_process_group_ranks(pp_group) if pp_size > 1 else None
    dtype = _dtype_of(model)
    device = next(model.parameters()).device
    by_global = {ref.megatron_name: param for ref, param in local_params(model, shape).values()}
    for ref in param_refs(shape):
        owner = _stage_of(ref, shape, pp_size)
        if owner == pp_rank and ref.expert is not None:
            tensors = _gather_expert(ref, by_global, shape, dtype, device)
        elif owner == pp_rank:
            local = by_global[ref.megatron_name].detach()
            if ref.split is not None and tp_size > 1:
                shards = [torch.empty_like(local) for _ in range(tp_size)]
                dist.all_gather(shards, local.contiguous(), group=tp_group)
            else:
                shards = [local]
            tensors = full_to_hf(ref, unshard(ref, shards), shape)
        else:
            tensors = [torch.empty(s, dtype=_hf_dtype(ref, dtype), device=device) for s in _hf_shapes(ref, shape)]
        if pp_size > 1:
            for t in tensors:
                dist.broadcast(t, src=pp_ranks[owner], group=pp_group)
        yield from zip(ref.hf_names, tensors, strict=True)


def _hf_dtype(ref: ParamRef, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype a ref's HF tensors leave the trainer in: the model's, but the expert bias's float32."""
    return torch.float32 if ref.megatron_name.endswith(_EXPERT_BIAS) else model_dtype


def mtp_tensor_names(shape: HFModelShape, names) -> list[str]:
    """The multi-token-prediction layers' tensors (``model.layers.{num_hidden_layers + i}.*``) among ``names``."""
    if not shape.mtp_layers:
        return []
    layers = range(shape.num_layers, shape.num_layers + shape.mtp_layers)
    return sorted(n for n in names if (m := _HF_LAYER.match(n)) is not None and int(m.group(1)) in layers)


def carried_tensors(shape: HFModelShape, folder: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors the Megatron model does not hold and a saved folder must still have:
    its multi-token-prediction layers (``model.layers.{num_hidden_layers + i}.*``), as stored."""
    if not shape.mtp_layers:
        return
    reader = SafetensorsFolder(folder)
    for name in mtp_tensor_names(shape, reader.weight_map):
        yield name, reader.get(name)


def _gather_expert(ref: ParamRef, by_global: dict, shape: HFModelShape, dtype: torch.dtype,
                   device: torch.device) -> list[torch.Tensor]:
    """One expert's HF tensors on every rank of this stage: its EP owner gathers the expert-TP
    slices, then broadcasts over the EP group (one expert at a time: never all experts at once)."""
    ep_rank, ep_size, _, etp_size = _expert_layout()
    owner = ref.expert // (shape.moe.num_experts // ep_size)
    if ep_rank == owner:
        local = by_global[ref.megatron_name].detach()
        shards = [local]
        if etp_size > 1:
            shards = [torch.empty_like(local) for _ in range(etp_size)]
            dist.all_gather(shards, local.contiguous(), group=parallel_state.get_expert_tensor_parallel_group())
        tensors = full_to_hf(ref, unshard(ref, shards), shape)
    else:
        tensors = [torch.empty(s, dtype=dtype, device=device) for s in _hf_shapes(ref, shape)]
    if ep_size > 1:
        group = parallel_state.get_expert_model_parallel_group()
        src = dist.get_process_group_ranks(group)[owner]
        for t in tensors:
            dist.broadcast(t, src=src, group=group)
    return tensors


def bucketed(tensors: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[NamedTensors]:
    """Group (name, tensor) pairs into lists of about ``bucket_bytes`` (a tensor never splits). A bucket never ends
    on an MLA layer's ``q_a_proj``: SGLang loads it fused with the ``kv_a_proj_with_mqa`` that follows it
    (``fused_qkv_a_proj_with_mqa``) only when both come in one load call, and silently drops a half that comes alone
    (deepseek_weight_loader.py's ``cached_a_proj`` lives for one call)."""
    bucket, size = [], 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes and not bucket[-1][0].endswith(".self_attn.q_a_proj.weight"):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


def save_hf(
    model: PolicyGPT, shape: HFModelShape, source_folder: str | Path, out_folder: str | Path,
    *, dtype: torch.dtype | None = None, max_shard_bytes: int = 4 << 30,
    tensors: Iterator[tuple[str, torch.Tensor]] | None = None,
) -> None:
    """Write an HF folder (config, tokenizer files copied from ``source_folder``, safetensors shards)
    of ``tensors`` (default: the model's, `iter_hf_tensors`), then the checkpoint's tensors the model does not
    hold (`carried_tensors`: MTP layers) as ``source_folder`` has them.

    Collective: every rank must call it; rank 0 writes.
    """
    from safetensors.torch import save_file

    out = Path(out_folder)
    writer = dist.get_rank() == 0
    if writer:
        out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0

    def add(name: str, t: torch.Tensor) -> None:
        nonlocal size
        if shards[-1] and size + t.numel() * t.element_size() > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.numel() * t.element_size()

    for name, t in tensors if tensors is not None else iter_hf_tensors(model, shape):
        if not writer:
            continue
        # the expert bias stays float32 (GLM checkpoints store it so; transformers keeps it so)
        keep = t.dtype if name.endswith("e_score_correction_bias") else dtype
        add(name, t.to("cpu", keep or t.dtype).contiguous())
    if writer:
        for name, t in carried_tensors(shape, source_folder):  # MTP layers, as the checkpoint has them
            add(name, t.contiguous())
        _write_shards(save_file, shards, out)
        src = Path(source_folder)
        for f in src.iterdir():
            if f.is_file() and not f.name.endswith((".safetensors", ".bin")) and f.name != "model.safetensors.index.json":
                shutil.copy2(f, out / f.name)
        if dtype is not None:
            cfg = json.loads((out / "config.json").read_text())
            name = str(dtype).removeprefix("torch.")
            cfg["dtype" if "dtype" in cfg or "torch_dtype" not in cfg else "torch_dtype"] = name
            (out / "config.json").write_text(json.dumps(cfg, indent=2))
    dist.barrier()


def _write_shards(save_file, shards: list[dict[str, torch.Tensor]], out: Path) -> None:
    if len(shards) == 1:
        save_file(shards[0], out / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map, total = {}, 0
    for i, part in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(part, out / file, metadata={"format": "pt"})
        for name, t in part.items():
            weight_map[name] = file
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
