"""Mixture-of-experts support in the HF engine: checkpoint-named expert weights onto transformers'
fused expert tensors, and the experts each token was routed to (for rollout routing replay)."""

from __future__ import annotations

import contextlib
import re

import torch
from transformers import PreTrainedModel

from slime_rl.rollout_hf.vision import vl_module_name

_CHECKPOINT_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_LAYER_INDEX = re.compile(r"\.layers\.(\d+)$")


def weight_target(name: str, params: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The tensor (or view) a checkpoint-named weight goes to. MoE checkpoints (and the trainer) name
    experts one by one (``mlp.experts.{e}.gate_proj.weight``); transformers 5 holds them fused:
    ``experts.gate_up_proj`` ``[experts, 2 * inter, hidden]`` (gate rows first) and
    ``experts.down_proj`` ``[experts, hidden, inter]``."""
    if name in params:
        return params[name]
    if (module := vl_module_name(name)) in params:  # a vision-language checkpoint's name (vision.py)
        return params[module]
    m = _CHECKPOINT_EXPERT.match(name)
    if m is None:
        return None
    prefix, expert, proj = m.group(1), int(m.group(2)), m.group(3)
    if proj == "down_proj":
        fused = params.get(f"{prefix}.down_proj")
        return None if fused is None else fused[expert]
    fused = params.get(f"{prefix}.gate_up_proj")
    if fused is None:
        return None
    gate, up = fused[expert].chunk(2, dim=0)
    return gate if proj == "gate_proj" else up


class RouterRecorder:
    """Hooks on an MoE model's routers (``mlp.gate`` of each MoE layer) that keep the experts each one chose while
    ``recording``: transformers 5's routers return ``(logits, weights, indices)``, and the indices are the family's
    own choice (GLM-4.5: sigmoid scores plus the correction bias, within the best groups; not the top-k of the
    logits). Where the MoE block chooses instead (``route_tokens_to_experts``: GLM-4.5 and DeepSeek-V3 in
    transformers 5.12, whose routers return their logits alone, and DeepSeek-V2, which never calls its gate
    module), that method's indices are kept. (transformers' ``output_router_logits`` also computes the
    load-balancing loss, which fails on cached decode.)"""

    def __init__(self, model: PreTrainedModel):
        self.chosen: dict[int, torch.Tensor] = {}  # by layer index: [tokens, k]
        self._on = False
        self.top_k = model.config.get_text_config().num_experts_per_tok
        self.num_layers = model.config.get_text_config().num_hidden_layers
        self.gates = {}
        for name, module in model.named_modules():
            layer = _LAYER_INDEX.search(name)
            if layer is not None and hasattr(getattr(module, "mlp", None), "gate") and hasattr(module.mlp, "experts"):
                self.gates[int(layer.group(1))] = module.mlp.gate
                if hasattr(module.mlp, "route_tokens_to_experts"):
                    module.mlp.route_tokens_to_experts = self._keep_route(int(layer.group(1)),
                                                                          module.mlp.route_tokens_to_experts)
                else:
                    module.mlp.gate.register_forward_hook(self._keep(int(layer.group(1))))

    def _keep_route(self, layer: int, route):
        """``route`` (a block's ``route_tokens_to_experts``) keeping the indices it returns: its integer tensor
        (GLM and DeepSeek return ``(indices, weights)``, DBRX ``(weights, indices)``)."""
        def routed(*args, **kwargs):
            out = route(*args, **kwargs)
            if self._on:
                self.chosen[layer] = next(t for t in out if not t.is_floating_point()).detach()
            return out

        return routed

    @classmethod
    def for_model(cls, model: PreTrainedModel) -> RouterRecorder | None:
        if getattr(model.config.get_text_config(), "num_experts_per_tok", None) is None:
            return None
        return cls(model)

    def _keep(self, layer: int):
        def hook(module, inputs, output) -> None:
            if not self._on:
                return
            if isinstance(output, tuple) and len(output) >= 3:  # (logits, weights, indices)
                chosen = output[2]
            else:  # a router that returns its logits only: softmax routing picks their top-k
                logits = output[0] if isinstance(output, tuple) else output
                chosen = logits.float().topk(self.top_k, dim=-1).indices
            self.chosen[layer] = chosen.detach()

        return hook

    @contextlib.contextmanager
    def recording(self):
        self.chosen, self._on = {}, True
        try:
            yield
        finally:
            self._on = False

    def take(self) -> dict[int, torch.Tensor]:
        chosen, self.chosen = self.chosen, {}
        return chosen


def routed_experts(chosen: dict[int, torch.Tensor], config, shape: torch.Size) -> torch.Tensor:
    """The experts of every token fed, ``[batch, seq, layers, k]`` int16 over all ``num_hidden_layers`` (as
    SGLang reports them; zeros at dense layers, such as GLM-4.5's first), from each MoE layer's ``[batch * seq,
    k]`` choices by layer index (`RouterRecorder.take`)."""
    text_config = config.get_text_config()
    k = text_config.num_experts_per_tok
    out = torch.zeros(*shape, text_config.num_hidden_layers, k, dtype=torch.int16)
    for layer, indices in chosen.items():
        out[..., layer, :] = indices.reshape(*shape, k).to(torch.int16).cpu()
    return out
