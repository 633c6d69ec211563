"""Mixture-of-experts support in the HF engine: checkpoint-named expert weights onto transformers'
fused expert tensors, and the experts each token was routed to (for rollout routing replay)."""

from __future__ import annotations

import contextlib
import re

import torch
from transformers import PreTrainedModel

_CHECKPOINT_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def weight_target(name: str, params: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The tensor (or view) a checkpoint-named weight goes to. MoE checkpoints (and the trainer) name
    experts one by one (``mlp.experts.{e}.gate_proj.weight``); transformers 5 holds them fused:
    ``experts.gate_up_proj`` ``[experts, 2 * inter, hidden]`` (gate rows first) and
    ``experts.down_proj`` ``[experts, hidden, inter]``."""
    if name in params:
        return params[name]
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
    """Forward hooks on an MoE model's routers (``mlp.gate`` of each layer) that keep their logits
    while ``recording``: the experts the engine chose are the top-k of these. (transformers'
    ``output_router_logits`` also computes the load-balancing loss, which fails on cached decode.)"""

    def __init__(self, model: PreTrainedModel):
        self.logits: list[torch.Tensor] = []
        self._on = False
        self.gates = [m.mlp.gate for m in model.modules() if hasattr(getattr(m, "mlp", None), "gate")
                      and hasattr(m.mlp, "experts")]
        for gate in self.gates:
            gate.register_forward_hook(self._keep)

    @classmethod
    def for_model(cls, model: PreTrainedModel) -> RouterRecorder | None:
        if getattr(model.config.get_text_config(), "num_experts_per_tok", None) is None:
            return None
        return cls(model)

    def _keep(self, module, inputs, output):
        if self._on:
            self.logits.append((output[0] if isinstance(output, tuple) else output).detach())

    @contextlib.contextmanager
    def recording(self):
        self.logits, self._on = [], True
        try:
            yield
        finally:
            self._on = False

    def take(self) -> list[torch.Tensor]:
        logits, self.logits = self.logits, []
        return logits


def routed_experts(router_logits, config, shape: torch.Size) -> torch.Tensor:
    """The top-k experts of every token fed, ``[batch, seq, layers, k]`` int16, from transformers'
    per-layer router logits (``[batch * seq, experts]`` each): MoE routing picks the top-k of the
    softmax of these, the same order as the top-k of the logits."""
    k = config.get_text_config().num_experts_per_tok
    chosen = [logits.float().topk(k, dim=-1).indices for logits in router_logits]
    return torch.stack(chosen, dim=1).reshape(*shape, len(chosen), k).to(torch.int16).cpu()
