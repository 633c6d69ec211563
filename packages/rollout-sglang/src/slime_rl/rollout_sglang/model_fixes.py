"""What SGLang 0.5.17's own model classes get wrong for RL weight syncs, and the fixes our servers load.

SGLang imports an external model package named by ``SGLANG_EXTERNAL_MODEL_PACKAGE`` and lets its classes
replace its own of the same architecture name (models/registry.py). Ours, `slime_rl.rollout_sglang.sglang_models`,
holds subclasses of SGLang's classes that differ only in ``load_weights``, which every way weights reach a server
goes through (the checkpoint at start, ``/update_weights_from_disk``, ``/update_weights_from_tensor``, the
flattened buckets, our delta loader). Their work is done by the functions here, which need no SGLang:

- ``LlamaForCausalLM`` renames every ``*.weight_scale_inv`` it is given to ``*.weight_scale`` (llama.py
  ``_legacy_load_weights``, and the V2 loader's ``_llama_remap``), but a block-FP8 linear layer holds its scales
  as ``weight_scale_inv`` (quantization/fp8.py): every scale was dropped, at start and in every sync, and the
  FP8 engine ran with scales of float32's minimum. `load_block_scales` loads them under their own name, as
  SGLang's Qwen2 loader does.
- ``Glm4MoeGate`` keeps a float32 copy of its router weight, made at its first forward and never rebuilt
  (glm4_moe.py's FIXME): after a sync the engine routed with the router it started with, and the weights
  checker does not hash the copy. `refresh_float32_copies` copies the new weights into it in place (a
  captured CUDA graph holds the copy's address).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

PACKAGE = "slime_rl.rollout_sglang.sglang_models"
#: SGLang's architecture names our package replaces (one module each in sglang_models/)
FIXED_ARCHITECTURES = frozenset({"LlamaForCausalLM", "Glm4MoeForCausalLM"})
#: (SGLang's fused parameter, the checkpoint's name in it, its shard): SGLang's Llama ``stacked_params_mapping``
LLAMA_STACKED = ((".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
                 (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1))
BLOCK_SCALE = ".weight_scale_inv"

NamedWeights = Iterable[tuple[str, torch.Tensor]]
Stacked = tuple[tuple[str, str, str | int], ...]


def launch_env(model_path: str | Path) -> dict[str, str]:
    """``SGLANG_EXTERNAL_MODEL_PACKAGE`` for a server of a model whose architecture our package fixes (none else:
    the engine's Python must then import slime_rl, as it must for our delta loader)."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}  # an attached server's model may live elsewhere
    if FIXED_ARCHITECTURES.isdisjoint(config.get("architectures") or ()):
        return {}
    return {"SGLANG_EXTERNAL_MODEL_PACKAGE": PACKAGE}


def load_block_scales(model: torch.nn.Module, weights: NamedWeights,
                      stacked: Stacked = LLAMA_STACKED) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` less the block-FP8 scales that ``model`` holds as ``weight_scale_inv``, which are loaded here
    by their parameters' own loaders (a fused q/k/v or gate/up scale by its shard, as for its weight). The rest
    stream on to the model's own ``load_weights``; a scale the model has no parameter for goes on too."""
    params = dict(model.named_parameters())
    for name, tensor in weights:
        if name.endswith(BLOCK_SCALE):
            target, shard = _fused_name(name, stacked)
            param = params.get(target)
            if param is not None:
                loader = getattr(param, "weight_loader", None)
                if loader is None:
                    param.data.copy_(tensor)
                elif shard is None:
                    loader(param, tensor)
                else:
                    loader(param, tensor, shard)
                continue
        yield name, tensor


def _fused_name(name: str, stacked: Stacked) -> tuple[str, str | int | None]:
    for fused, part, shard in stacked:
        if part in name:
            return name.replace(part, fused), shard
    return name, None


def refresh_float32_copies(model: torch.nn.Module) -> int:
    """Copy each module's ``weight`` into its cached ``_weight_fp32`` (SGLang's GLM-4.5 router), in place; how many."""
    refreshed = 0
    for module in model.modules():
        copy = getattr(module, "_weight_fp32", None)
        if isinstance(copy, torch.Tensor):
            copy.copy_(module.weight.data)
            refreshed += 1
    return refreshed
