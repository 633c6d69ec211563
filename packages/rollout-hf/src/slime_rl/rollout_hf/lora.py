"""Adapter-only weight syncs for the HF engine (``rollout.lora_sync: adapter``).

The trainer sends each targeted projection's LoRA pair under PEFT names (core/lora.py). The engine
leaves the base weights as they are and adds ``scaling * B (A x)`` to each adapted projection's
output through a forward hook, as the trainer's forward does. Merging into the weights
(``core.lora.merged``) would be exact only in fp32: in bf16 the merged weight is rounded, which drops
most of a small adapter's update. On the demo that grew the trainer-engine log-prob gap from 0.05
to 0.26."""

from __future__ import annotations

import torch

from slime_rl.core.algorithms.lora import PEFT_PREFIX, hf_name
from slime_rl.core.contracts import NamedTensors


class AdapterSync:
    """The adapters the engine serves, hooked onto its projections; pairs A and B as buckets bring them
    (a pair may straddle two buckets) and swaps a pair in once it is whole."""

    def __init__(self, model: torch.nn.Module, scaling: float | None):
        self.model = model
        self.scaling = scaling  # None: this run sends full weights, never adapters
        self.pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # module name -> (A, B) in use
        self._half: dict[str, dict[str, torch.Tensor]] = {}  # pairs that so far have only A or only B

    @staticmethod
    def split(named_tensors: NamedTensors) -> tuple[NamedTensors, NamedTensors]:
        """(full weights, adapter tensors) of a bucket."""
        full = [(n, t) for n, t in named_tensors if not n.startswith(PEFT_PREFIX)]
        return full, [(n, t) for n, t in named_tensors if n.startswith(PEFT_PREFIX)]

    def check(self, adapters: NamedTensors) -> None:
        """Every adapter tensor names a linear of the model and fits it; nothing is applied before this passes."""
        if adapters and self.scaling is None:
            raise ValueError(f"update_weights: got LoRA adapter tensors ({adapters[0][0]!r}) but this engine was"
                             " not built for adapter syncs; set trainer.lora.rank and rollout.lora_sync=adapter")
        for name, tensor in adapters:
            module_name, which = self._module_of(name)
            module = self._linear(module_name)
            if module is None:
                raise ValueError(f"update_weights: adapter {name!r} is for {module_name!r}, not a linear of the model")
            out, inp = module.weight.shape
            if tensor.dim() != 2 or (which == "A" and tensor.shape[1] != inp) or (which == "B" and tensor.shape[0] != out):
                raise ValueError(f"update_weights: adapter {name!r} has shape {tuple(tensor.shape)}, which does not fit"
                                 f" {module_name!r} {tuple(module.weight.shape)}")

    def apply(self, adapters: NamedTensors) -> None:
        """Serve each whole pair from now on (the first pair of a projection hooks it)."""
        for name, tensor in adapters:
            module_name, which = self._module_of(name)
            pair = self._half.setdefault(module_name, {})
            pair[which] = tensor
            if len(pair) < 2:
                continue
            del self._half[module_name]
            weight = self._linear(module_name).weight
            if module_name not in self.pairs:
                self._linear(module_name).register_forward_hook(self._hook(module_name))
            self.pairs[module_name] = (pair["A"].to(weight.device, weight.dtype),
                                       pair["B"].to(weight.device, weight.dtype))

    def finish(self) -> None:
        """At a version's last bucket: every A met its B."""
        if self._half:
            name, pair = next(iter(self._half.items()))
            self._half.clear()
            raise ValueError(f"update_weights: the version ended with only lora_{next(iter(pair))} of {name!r}; the"
                             " trainer sends A and B of every adapter")

    def _hook(self, module_name: str):
        def add_adapter(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
            lora_a, lora_b = self.pairs[module_name]
            low = torch.nn.functional.linear(args[0], lora_a)
            return out + torch.nn.functional.linear(low, lora_b) * self.scaling

        return add_adapter

    @staticmethod
    def _module_of(peft_weight_name: str) -> tuple[str, str]:
        weight_name, which = hf_name(peft_weight_name)
        return weight_name.removesuffix(".weight"), which

    def _linear(self, module_name: str) -> torch.nn.Linear | None:
        try:
            module = self.model.get_submodule(module_name)
        except AttributeError:
            return None
        return module if isinstance(module, torch.nn.Linear) else None
