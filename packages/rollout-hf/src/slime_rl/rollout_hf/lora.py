"""Adapter-only weight syncs for the HF engine (``rollout.lora_sync: adapter``).

The trainer sends each targeted projection's LoRA pair under PEFT names (core/lora.py). The engine
keeps the base weight of every projection an adapter has reached and sets the live weight to
``merged(base, A, B, scaling)``: exact, and the forward stays a plain transformers model."""

from __future__ import annotations

import torch

from slime_rl.core.contracts import NamedTensors
from slime_rl.core.lora import PEFT_PREFIX, hf_name, merged
from slime_rl.rollout_hf.moe import weight_target


class AdapterMerger:
    """Pairs A and B as buckets bring them (a pair may straddle two) and merges each whole pair."""

    def __init__(self, scaling: float | None):
        self.scaling = scaling  # None: this run sends full weights, never adapters
        self.base: dict[str, torch.Tensor] = {}  # HF weight name -> the base weight, kept from the first adapter
        self._half: dict[str, dict[str, torch.Tensor]] = {}  # pairs that so far have only A or only B

    @staticmethod
    def split(named_tensors: NamedTensors) -> tuple[NamedTensors, NamedTensors]:
        """(full weights, adapter tensors) of a bucket."""
        full = [(n, t) for n, t in named_tensors if not n.startswith(PEFT_PREFIX)]
        return full, [(n, t) for n, t in named_tensors if n.startswith(PEFT_PREFIX)]

    def check(self, adapters: NamedTensors, params: dict[str, torch.Tensor]) -> None:
        """Every adapter tensor names a model weight and fits it; nothing is applied before this passes."""
        if adapters and self.scaling is None:
            raise ValueError(f"update_weights: got LoRA adapter tensors ({adapters[0][0]!r}) but this engine was"
                             " not built for adapter syncs; set trainer.lora.rank and rollout.lora_sync=adapter")
        for name, tensor in adapters:
            weight_name, which = hf_name(name)
            target = weight_target(weight_name, params)
            if target is None:
                raise ValueError(f"update_weights: adapter {name!r} is for {weight_name!r}, which the model lacks")
            out, inp = target.shape
            if tensor.dim() != 2 or (which == "A" and tensor.shape[1] != inp) or (which == "B" and tensor.shape[0] != out):
                raise ValueError(f"update_weights: adapter {name!r} has shape {tuple(tensor.shape)}, which does not fit"
                                 f" {weight_name!r} {tuple(target.shape)}")

    @torch.no_grad()
    def apply(self, adapters: NamedTensors, params: dict[str, torch.Tensor]) -> None:
        """Set each weight whose pair is complete to ``base + scaling * B A``."""
        for name, tensor in adapters:
            weight_name, which = hf_name(name)
            pair = self._half.setdefault(weight_name, {})
            pair[which] = tensor
            if len(pair) < 2:
                continue
            del self._half[weight_name]
            target = weight_target(weight_name, params)
            base = self.base.get(weight_name)
            if base is None:
                base = self.base[weight_name] = target.detach().clone()
            target.copy_(merged(base, pair["A"].to(target.device), pair["B"].to(target.device), self.scaling))

    def forget(self, full: NamedTensors) -> None:
        """A full weight sync replaces the weight: its kept base (if any) is no longer the base."""
        for name, _ in full:
            self.base.pop(name, None)

    def finish(self) -> None:
        """At a version's last bucket: every A met its B."""
        if self._half:
            name, pair = next(iter(self._half.items()))
            self._half.clear()
            raise ValueError(f"update_weights: the version ended with only lora_{next(iter(pair))} of {name!r}; the"
                             " trainer sends A and B of every adapter")
