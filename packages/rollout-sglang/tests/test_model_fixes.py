"""The fixes our SGLang servers load for SGLang 0.5.17's model classes (model_fixes.py), on modules shaped like
SGLang's: a Llama's block-FP8 scales reach their parameters, by shard where q/k/v and gate/up are fused, instead
of the name SGLang's Llama loader renames them to; GLM-4.5's float32 router copy follows a new router weight."""

from __future__ import annotations

import json

import torch
from torch import nn

from slime_rl.rollout_sglang import model_fixes


class FusedScale(nn.Parameter):
    """A fused layer's block-scale parameter as SGLang builds it: its loader places each shard's rows."""

    def __new__(cls, rows: dict):
        param = super().__new__(cls, torch.full((sum(rows.values()), 2), torch.finfo(torch.float32).min),
                                requires_grad=False)
        param.offsets, start = {}, 0
        for shard, n in rows.items():
            param.offsets[shard], start = (start, n), start + n
        param.weight_loader = param.load
        return param

    def load(self, param, tensor, shard):
        start, n = self.offsets[shard]
        param.data[start:start + n].copy_(tensor)


class Linear(nn.Module):
    def __init__(self, scale: nn.Parameter):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4, 4), requires_grad=False)
        self.weight_scale_inv = scale


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv_proj = Linear(FusedScale({"q": 2, "k": 1, "v": 1}))
        self.o_proj = Linear(nn.Parameter(torch.zeros(2, 2), requires_grad=False))  # no weight_loader: copied


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = Attention()


def test_block_scales_reach_their_parameters_and_the_rest_streams_on_in_order():
    model = nn.Module()
    model.layers = nn.ModuleList([Layer()])
    prefix = "layers.0.self_attn"
    q, k, v, o = torch.full((2, 2), 1.0), torch.full((1, 2), 2.0), torch.full((1, 2), 3.0), torch.full((2, 2), 4.0)
    weights = [(f"{prefix}.q_proj.weight", torch.ones(2, 4)), (f"{prefix}.q_proj.weight_scale_inv", q),
               (f"{prefix}.k_proj.weight_scale_inv", k), (f"{prefix}.v_proj.weight_scale_inv", v),
               (f"{prefix}.o_proj.weight", torch.ones(4, 4)), (f"{prefix}.o_proj.weight_scale_inv", o),
               ("layers.9.mlp.down_proj.weight_scale_inv", torch.ones(1))]  # no such parameter: passed on
    passed = list(model_fixes.load_block_scales(model, iter(weights)))  # a stream, as a checkpoint load gives
    assert [name for name, _ in passed] == [f"{prefix}.q_proj.weight", f"{prefix}.o_proj.weight",
                                            "layers.9.mlp.down_proj.weight_scale_inv"]
    attention = model.layers[0].self_attn
    assert torch.equal(attention.qkv_proj.weight_scale_inv.data, torch.cat([q, k, v]))
    assert torch.equal(attention.o_proj.weight_scale_inv.data, o)


def test_the_float32_router_copy_follows_the_new_weight_in_place():
    gate = nn.Module()
    gate.weight = nn.Parameter(torch.ones(4, 8, dtype=torch.bfloat16), requires_grad=False)
    gate._weight_fp32 = gate.weight.data.float()  # what Glm4MoeGate.forward caches at its first call
    unused = nn.Module()
    unused.weight = nn.Parameter(torch.ones(2))
    unused._weight_fp32 = None  # never ran a forward: built from the new weights when it does
    model = nn.ModuleList([gate, unused])
    held = gate._weight_fp32.data_ptr()
    gate.weight.data.copy_(torch.full((4, 8), 3.0))  # a sync's load
    assert model_fixes.refresh_float32_copies(model) == 1
    assert gate._weight_fp32.data_ptr() == held and torch.equal(gate._weight_fp32, torch.full((4, 8), 3.0))


def test_servers_of_the_fixed_architectures_load_our_model_package(tiny_model, standin_python, tmp_path):
    from test_server import environ_of_a_server

    assert model_fixes.launch_env(tiny_model) == {"SGLANG_EXTERNAL_MODEL_PACKAGE": model_fixes.PACKAGE}  # a Llama
    environ = environ_of_a_server(tiny_model, standin_python, tmp_path)
    assert environ["SGLANG_EXTERNAL_MODEL_PACKAGE"] == "slime_rl.rollout_sglang.sglang_models"
    for architecture, fixed in (("Glm4MoeForCausalLM", True), ("Qwen2ForCausalLM", False)):
        folder = tmp_path / architecture
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"architectures": [architecture]}))
        assert bool(model_fixes.launch_env(folder)) is fixed
    assert model_fixes.launch_env(tmp_path / "elsewhere") == {}


def test_the_package_holds_one_module_per_fixed_architecture():
    """SGLang imports every module of the package and maps each EntryClass by its class name."""
    from pathlib import Path

    package = Path(model_fixes.__file__).parent / "sglang_models"
    entries = set()
    for module in package.glob("*.py"):
        if module.name != "__init__.py":
            source = module.read_text()
            entries |= {line.split("(")[0].removeprefix("class ").strip() for line in source.splitlines()
                        if line.startswith("class ")}
            assert "EntryClass = " in source
    assert entries == model_fixes.FIXED_ARCHITECTURES
