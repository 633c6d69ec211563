"""Routed experts where an MoE block chooses them itself (`RouterRecorder`): transformers 5.12 (the GPU machine's)
has GLM-4.5's and DeepSeek-V3's routers return their logits alone and the block pick the experts in
``route_tokens_to_experts`` (sigmoid scores plus the correction bias, within the best groups: not the logits'
top-k), and DeepSeek-V2's block never calls its gate module. transformers 5.25 (here) routes in the router, which
test_hf_engine.py's routed-experts test covers; this builds 5.12's layout by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from slime_rl.rollout_hf.moe import RouterRecorder, routed_experts

HIDDEN, EXPERTS, TOP_K = 8, 8, 2


class BlockRoutedMoE(nn.Module):
    """5.12's GLM-4.5 / DeepSeek-V3 MoE block, cut down to its routing: a correction bias that favours the first
    experts makes the choice differ from the logits' top-k. ``calls_gate=False``: 5.12's DeepSeek-V2, which
    multiplies by ``gate.weight`` without calling the gate."""

    def __init__(self, calls_gate: bool):
        super().__init__()
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = nn.Identity()
        self.bias = torch.linspace(1.0, -1.0, EXPERTS)
        self.calls_gate = calls_gate

    def route_tokens_to_experts(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        indices = (logits.sigmoid() + self.bias).topk(TOP_K, dim=-1).indices
        return indices, logits.sigmoid().gather(1, indices)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, HIDDEN)
        logits = self.gate(flat) if self.calls_gate else nn.functional.linear(flat, self.gate.weight)
        self.route_tokens_to_experts(logits)
        return hidden


class Layer(nn.Module):
    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.mlp = mlp


class TwoLayerModel(nn.Module):
    """A dense first layer (no router), then the MoE block; named as transformers names its layers."""

    def __init__(self, calls_gate: bool):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([Layer(nn.Identity()), Layer(BlockRoutedMoE(calls_gate))])
        text = SimpleNamespace(num_experts_per_tok=TOP_K, num_hidden_layers=2)
        self.config = SimpleNamespace(get_text_config=lambda: text)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for layer in self.model.layers:
            hidden = layer.mlp(hidden)
        return hidden


@pytest.mark.parametrize("calls_gate", [True, False], ids=["glm4.5-deepseek-v3", "deepseek-v2"])
def test_the_blocks_own_choice_is_recorded_not_the_logits_top_k(calls_gate):
    torch.manual_seed(0)
    model = TwoLayerModel(calls_gate)
    block = model.model.layers[1].mlp
    recorder = RouterRecorder.for_model(model)
    hidden = torch.randn(1, 16, HIDDEN)
    with recorder.recording():
        model(hidden)
    routed = routed_experts(recorder.take(), model.config, torch.Size([1, 16]))
    assert routed.shape == (1, 16, 2, TOP_K)
    assert torch.equal(routed[0, :, 0], torch.zeros(16, TOP_K, dtype=routed.dtype))  # the dense layer
    logits = hidden.reshape(-1, HIDDEN) @ block.gate.weight.T
    chosen = block.route_tokens_to_experts(logits)[0].sort(-1).values
    assert torch.equal(routed[0, :, 1].sort(-1).values, chosen.to(routed.dtype))
    assert not torch.equal(chosen, logits.topk(TOP_K, dim=-1).indices.sort(-1).values)  # the bias mattered
    with torch.no_grad():  # outside recording: nothing kept
        model(hidden)
    assert recorder.take() == {}
