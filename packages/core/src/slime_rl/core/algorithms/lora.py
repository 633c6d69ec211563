"""LoRA as the trainer, the weight sync and the engines share it (``trainer.lora``, ``rollout.lora_sync``).

An adapter is the pair (A, B) beside a frozen projection ``W`` (HF name ``...q_proj.weight``):
``y = W x + scaling * B (A x)``, ``A: [rank, in]``, ``B: [out, rank]``, ``scaling = alpha / rank``.
Between packages adapters travel under PEFT's names (``base_model.model.<module>.lora_A.weight``), so
a saved adapter folder, a sync bucket and SGLang's ``/load_lora_adapter_from_tensors`` all read the same.
Each weight version is its own adapter name (`adapter_name`): an engine serves a new version under a new
name while requests still decoding under the old one finish."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from slime_rl.core.config.schema import Config

PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...]

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def lora_spec(cfg: Config) -> LoraSpec | None:
    """The run's adapters, or None when it trains the full model (``trainer.lora.rank`` 0)."""
    lora = cfg.trainer.lora
    if lora.rank == 0:
        return None
    return LoraSpec(lora.rank, lora.alpha, lora.dropout, tuple(lora.target_modules))


def syncs_adapters(cfg: Config) -> bool:
    """Whether a weight sync sends adapters only (LoRA on and ``rollout.lora_sync: adapter``)."""
    return cfg.trainer.lora.rank > 0 and cfg.rollout.lora_sync == "adapter"


def adapter_name(version: int) -> str:
    """The name an engine serves weight version ``version``'s adapter under."""
    return f"slime-v{version}"


def peft_name(hf_weight_name: str, which: str) -> str:
    """``model.layers.0.self_attn.q_proj.weight``, "A" -> ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``."""
    if which not in ("A", "B") or not hf_weight_name.endswith(".weight"):
        raise ValueError(f"peft_name({hf_weight_name!r}, {which!r}): want an HF '.weight' name and 'A' or 'B'")
    return f"{PEFT_PREFIX}{hf_weight_name[: -len('.weight')]}.lora_{which}.weight"


def hf_name(peft_weight_name: str) -> tuple[str, str]:
    """The inverse of `peft_name`: (HF weight name, "A" or "B")."""
    body = peft_weight_name.removeprefix(PEFT_PREFIX)
    for which in ("A", "B"):
        suffix = f".lora_{which}.weight"
        if body.endswith(suffix) and body != peft_weight_name:
            return body[: -len(suffix)] + ".weight", which
    raise ValueError(f"{peft_weight_name!r} is not a PEFT LoRA weight name ({PEFT_PREFIX}<module>.lora_A|B.weight)")


def peft_adapter_config(spec: LoraSpec, base_model: str) -> dict[str, Any]:
    """The ``adapter_config.json`` of a PEFT LoRA folder for ``spec`` (what transformers/PEFT and SGLang read)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout,
        "target_modules": list(spec.target_modules), "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "inference_mode": True,
    }


def merged(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``weight + scaling * B @ A``, computed in float32 and returned in ``weight``'s dtype."""
    delta = (lora_b.float() @ lora_a.float()) * scaling
    return (weight.float() + delta).to(weight.dtype)
