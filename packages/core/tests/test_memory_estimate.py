"""The trainer's memory estimate (config/memory.py) from a config.json alone, and the config check that
refuses a model that clearly cannot fit (issue 34: a 70B full fine-tune was accepted on a 23 GB CPU machine)."""

from __future__ import annotations

import json
import warnings

import pytest

from slime_rl.core.config import Config, ConfigError, load_config, memory
from slime_rl.core.config.memory import MemoryWarning, ModelSize, activation_bytes, estimate_memory

LLAMA_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
             "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
             "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False}
TINY = {**LLAMA_70B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256}
GB = 10**9


def model_folder(tmp_path, hf: dict, name: str):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf))  # no weights: the estimate needs the shape only
    return folder


def load(tmp_path, folder, *overrides):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"input": "1 + 1 =", "label": "2"}\n')
    return load_config(None, [f"model.path={folder}", f"data.prompt_data={prompts}", "cluster.device=cpu",
                              *overrides])


@pytest.fixture
def ram_23gb(monkeypatch):
    monkeypatch.setattr(memory, "available_ram_bytes", lambda: 23 * GB)


def test_the_parameter_count_of_a_70b_llama_shape():
    size = ModelSize.from_hf(LLAMA_70B)
    params = size.layers * (size.attention_params + size.dense_mlp_params) + 2 * size.embedding_params
    assert params == pytest.approx(70.55e9, rel=1e-3)  # Llama-3-70B: 70.6B, norms aside


def test_a_70b_full_fine_tune_on_a_23gb_cpu_machine_is_refused_with_the_estimate(tmp_path, ram_23gb):
    folder = model_folder(tmp_path, LLAMA_70B, "llama70b")
    with pytest.raises(ConfigError) as err:
        load(tmp_path, folder)
    message = str(err.value)
    assert message.startswith(f"model.path: {folder} does not fit: about ")
    assert "per trainer rank; 21.4 GiB of RAM available on this machine gives 21.4 GiB a rank" in message
    assert "weights 262.8 GiB" in message and "float32, full fine-tuning" in message  # 70.55e9 x 4 bytes
    assert "trainer.lora.rank=16" in message and "tensor_model_parallel_size" in message
    assert "\n" not in message


def test_a_tiny_model_passes_and_a_close_one_warns(tmp_path, ram_23gb, monkeypatch):
    folder = model_folder(tmp_path, TINY, "tiny")
    with warnings.catch_warnings():
        warnings.simplefilter("error", MemoryWarning)
        cfg = load(tmp_path, folder)
    estimate, limit = memory.check_memory(cfg)
    assert 0 < estimate.total < limit.bytes_per_rank / 100
    monkeypatch.setattr(memory, "available_ram_bytes", lambda: int(estimate.total * 1.1))  # it may fit: a warning
    with pytest.warns(MemoryWarning, match="may not fit: about"):
        memory.check_memory(cfg)


def test_lora_lowers_the_estimate_to_adapter_gradients_and_states(tmp_path):
    size = ModelSize.from_hf(LLAMA_70B)
    full = estimate_memory(Config(), size, "cuda")
    lora = estimate_memory(Config.model_validate({"trainer": {"lora": {"rank": 16}}}), size, "cuda")
    assert lora.total < full.total / 3
    adapters = size.lora_params(16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    assert lora.terms["gradients"] == adapters * 4  # fp32 gradients of the adapters only
    assert lora.terms["optimizer"] == adapters * 12  # Adam's two fp32 moments and the fp32 main copy
    assert lora.terms["weights"] == pytest.approx(full.terms["weights"], rel=0.01)  # the frozen base stays


def test_tensor_parallel_2_halves_the_weights_term():
    size = ModelSize.from_hf(LLAMA_70B)
    one = estimate_memory(Config(), size, "cuda")
    two = estimate_memory(Config.model_validate({"parallel": {"tensor_model_parallel_size": 2},
                                                 "cluster": {"actor_num_gpus_per_node": 2}}), size, "cuda")
    assert two.terms["weights"] == pytest.approx(one.terms["weights"] / 2, rel=1e-6)
    assert two.terms["optimizer"] == pytest.approx(one.terms["optimizer"] / 2, rel=1e-6)


def test_experts_split_over_expert_parallel_ranks():
    moe = {**TINY, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64}
    size = ModelSize.from_hf(moe)
    assert size.expert_params == 8 * 3 * 64 * 64
    cfg = {"cluster": {"actor_num_gpus_per_node": 2}}
    one = estimate_memory(Config.model_validate(cfg), size, "cuda")
    two = estimate_memory(Config.model_validate({**cfg, "parallel": {"expert_model_parallel_size": 2}}), size, "cuda")
    saved = size.layers * size.expert_params / 2 * 2  # half the experts, in bf16
    assert one.terms["weights"] - two.terms["weights"] == pytest.approx(saved)


def test_the_activation_term_follows_its_formula():
    size = ModelSize.from_hf(TINY)
    per_layer = 4 * 64 + (2 * 4 + 2 * 2) * 16 + 4 * 128
    logits = 3 * 1000 * 256 * 4
    got = activation_bytes(size, tokens=1000, tp=1, pp=1, sequence_parallel=False, recompute=False,
                           dtype_bytes=2, device="cpu")
    assert got == 1000 * 2 * 2 * per_layer + logits
    recomputed = activation_bytes(size, tokens=1000, tp=1, pp=1, sequence_parallel=False, recompute=True,
                                  dtype_bytes=2, device="cpu")
    assert recomputed == 1000 * 2 * (2 * 64 + per_layer) + logits


def test_no_config_json_means_no_estimate_and_no_refusal(tmp_path, ram_23gb):
    folder = tmp_path / "empty"
    folder.mkdir()
    cfg = load(tmp_path, folder)
    assert memory.check_memory(cfg) is None
    assert memory.memory_line(cfg, "cpu") == f"memory: no estimate ({folder} has no config.json with the model's shape)"
