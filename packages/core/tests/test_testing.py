"""slime_rl.core.testing: the tiny models every package's tests build, offline."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from slime_rl.core.testing import stdlib_text, tiny_config, tiny_model, tiny_model_folder, train_tokenizer

torch.set_num_threads(1)


def test_a_tiny_model_folder_loads_like_any_model(tmp_path):
    folder = tiny_model_folder(tmp_path / "m", "llama", hidden_size=32, num_heads=4, dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert model.dtype == torch.bfloat16 and model.config.num_key_value_heads == 2 and model.config.intermediate_size == 64
    assert model.config.vocab_size == len(tokenizer) <= 1024
    assert model.config.eos_token_id == model.config.bos_token_id == tokenizer.eos_token_id == tokenizer.pad_token_id
    ids = tokenizer("def f(x):\n    return x").input_ids
    assert tokenizer.decode(ids) == "def f(x):\n    return x"
    with torch.no_grad():
        assert model(torch.tensor([ids])).logits.shape == (1, len(ids), len(tokenizer))


def test_the_same_seed_gives_the_same_weights():
    config = tiny_config("qwen3", vocab_size=64, head_dim=32)
    same = [tiny_model(config, seed=1).state_dict() for _ in range(2)]
    other = tiny_model(config, seed=2).state_dict()
    assert all(torch.equal(same[0][k], same[1][k]) for k in same[0])
    assert not torch.equal(same[0]["lm_head.weight"], other["lm_head.weight"])
    norms = [k for k in same[0] if "norm" in k]
    assert all(torch.equal(same[0][k], torch.ones_like(same[0][k])) for k in norms)
    perturbed = tiny_model(config, seed=1, perturb_norms=True).state_dict()
    assert not any(torch.equal(perturbed[k], same[0][k]) for k in norms)


def test_the_tokenizer_puts_the_special_tokens_first():
    tok = train_tokenizer(stdlib_text(2), vocab_size=400, special_tokens=["<s>", "</s>"], bos_token="<s>",
                          eos_token="</s>")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token, len(tok)) == (0, 1, None, 400)
    plain = train_tokenizer(["a b"] * 5, vocab_size=300, special_tokens=["<eos>"])  # eos: the first special token
    assert (plain.eos_token, plain.eos_token_id, plain.bos_token) == ("<eos>", 0, None)


def test_an_unknown_family_is_named():
    with pytest.raises(ValueError, match="family: 'gpt2'; use one of llama, qwen2, qwen3"):
        tiny_config("gpt2", vocab_size=64)


def test_a_tiny_glm4_moe_has_what_its_family_has():
    """A dense first layer then MoE layers, grouped experts, a shared expert, partial RoPE, and a router
    correction bias that is not zeros (a fresh transformers model's are; a real checkpoint's are learnt)."""
    config = tiny_config("glm4_moe", vocab_size=64)
    assert (config.first_k_dense_replace, config.n_group, config.topk_group, config.n_shared_experts) == (1, 2, 1, 1)
    assert config.rope_parameters["partial_rotary_factor"] == 0.5 and config.routed_scaling_factor != 1.0
    weights = tiny_model(config, seed=1).state_dict()
    assert "model.layers.0.mlp.gate_proj.weight" in weights and "model.layers.1.mlp.shared_experts.up_proj.weight" in weights
    bias = weights["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.abs().min() > 0 and torch.equal(bias, tiny_model(config, seed=1).state_dict()[
        "model.layers.1.mlp.gate.e_score_correction_bias"])
