"""Adapter-only weight syncs into HFEngine: the engine then computes what transformers + PEFT compute
with the same adapters, each version replaces the last (the base weights never change), and a
version that ends with half a pair, or adapters sent to an engine not built for them, is refused."""

from __future__ import annotations

import asyncio

import pytest
import torch

from slime_rl.core.algorithms.lora import LoraSpec, peft_adapter_config, peft_name
from slime_rl.rollout_hf.engine import HFEngine

SPEC = LoraSpec(rank=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "v_proj", "down_proj"))


def random_adapters(model, seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, weight in model.state_dict().items():
        if name.endswith(tuple(f"{m}.weight" for m in SPEC.target_modules)):
            out.append((peft_name(name, "A"), torch.randn(SPEC.rank, weight.shape[1], generator=g) * 0.1))
            out.append((peft_name(name, "B"), torch.randn(weight.shape[0], SPEC.rank, generator=g) * 0.1))
    return out


def peft_logits(base_model, adapters, ids: torch.Tensor, tmp_path) -> torch.Tensor:
    import json

    import peft
    from safetensors.torch import save_file

    folder = tmp_path / "adapter"
    folder.mkdir(exist_ok=True)
    save_file(dict(adapters), folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps(peft_adapter_config(SPEC, "base")))
    with torch.no_grad():
        return peft.PeftModel.from_pretrained(base_model, str(folder)).eval()(ids).logits


def test_adapter_sync_matches_peft_and_each_version_replaces_the_last(tokenizer, make_model, tmp_path):
    model = make_model("llama", len(tokenizer))
    base = {n: t.clone() for n, t in model.state_dict().items()}
    engine = HFEngine(model, tokenizer, lora_scaling=SPEC.scaling)
    ids = torch.tensor([tokenizer("Question: What is 3 + 4?\nAnswer:").input_ids])
    for version, seed in ((1, 0), (2, 1)):
        adapters = random_adapters(model, seed)
        half = len(adapters) // 2 + 1  # odd: one pair straddles the two buckets
        asyncio.run(engine.update_weights(adapters[:half], version=version, last=False))
        asyncio.run(engine.update_weights(adapters[half:], version=version, last=True))
        assert engine.weight_version == version
        with torch.no_grad():
            ours = engine.model(ids).logits.log_softmax(-1)
        reference = make_model("llama", len(tokenizer))
        reference.load_state_dict(base)
        with torch.no_grad():
            base_log_probs = reference(ids).logits.log_softmax(-1)
        expected = peft_logits(reference, adapters, ids, tmp_path).log_softmax(-1)
        assert torch.allclose(ours, expected, atol=1e-5, rtol=0), (ours - expected).abs().max()
        assert not torch.allclose(ours, base_log_probs, atol=1e-3)  # the adapters matter
    # the base weights never moved: the adapters ride beside them
    assert all(torch.equal(t, base[n]) for n, t in model.state_dict().items())


def test_adapter_sync_refusals(tokenizer, make_model):
    model = make_model("llama", len(tokenizer))
    adapters = random_adapters(model, 0)
    with pytest.raises(ValueError, match="rollout.lora_sync=adapter"):
        asyncio.run(HFEngine(model, tokenizer).update_weights(adapters, version=1, last=True))
    engine = HFEngine(model, tokenizer, lora_scaling=SPEC.scaling)
    with pytest.raises(ValueError, match="only lora_A"):
        asyncio.run(engine.update_weights(adapters[:1], version=1, last=True))
    wrong = [(adapters[0][0], torch.zeros(SPEC.rank, 3))]
    with pytest.raises(ValueError, match="does not fit"):
        asyncio.run(engine.update_weights(wrong, version=1, last=True))
    assert engine.weight_version == 0
