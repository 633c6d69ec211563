"""The trainer's memory estimate (config/memory.py) from a config.json alone, and the config check that
refuses a model that clearly cannot fit (issue 34: a 70B full fine-tune was accepted on a 23 GB CPU machine)."""

from __future__ import annotations

import dataclasses
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


def test_shared_experts_count_in_each_family_s_names():
    qwen2 = ModelSize.from_hf({**TINY, "num_experts": 8, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 96})
    glm = ModelSize.from_hf({**TINY, "n_routed_experts": 8, "moe_intermediate_size": 64, "n_shared_experts": 2})
    assert (qwen2.shared_expert_intermediate, glm.shared_expert_intermediate) == (96, 128)
    assert glm.dense_mlp_params == 3 * 64 * 128


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_mla_attention_is_counted_as_transformers_builds_it(q_lora_rank):
    """DeepSeek's multi-head latent attention: its projections' weights are those transformers' layer holds, and an
    SGLang engine caches one kv latent plus the rope key a token and layer (not K and V of every head)."""
    from slime_rl.core.testing import tiny_config, tiny_model

    config = tiny_config("deepseek_v3", vocab_size=256, q_lora_rank=q_lora_rank)
    attention = tiny_model(config).model.layers[0].self_attn
    size = ModelSize.from_hf(config.to_dict())
    assert size.attention_params == sum(p.numel() for n, p in attention.named_parameters() if "layernorm" not in n)
    assert (size.kv_heads, size.head_dim) == (4, (12 + 8 + 10) // 2)
    cfg = Config.model_validate({"rollout": {"max_response_len": 64}, "cluster": {"rollout_num_gpus_per_engine": 2}})
    cfg.rollout.engine = "sglang"
    assert memory.engine_estimate(cfg, size, "cuda").kv_bytes_per_token == 2 * (16 + 8) * 2  # layers, latent+rope, bf16
    # the trainer's TP ranks each hold the down-projections whole (and 1/TP of the rest)
    down = ("q_a_proj", "kv_a_proj_with_mqa")
    assert size.mla_replicated_params == sum(p.numel() for n, p in attention.named_parameters() if n.startswith(down))
    one, two = (estimate_memory(Config.model_validate({"parallel": {"tensor_model_parallel_size": tp},
                                                       "cluster": {"actor_num_gpus_per_node": tp}}), size, "cuda")
                for tp in (1, 2))
    split_half = (size.attention_params - size.mla_replicated_params) / 2 * size.layers * 2  # bf16 bytes
    assert one.terms["weights"] - two.terms["weights"] == pytest.approx(split_half + (size.dense_mlp_params / 2 * size.layers
                                                                                       + size.embedding_params) * 2)


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


def long_config(**parallel) -> Config:
    return Config.model_validate({
        "rollout": {"max_prompt_len": 1024, "max_response_len": 31744},
        "parallel": parallel, "cluster": {"actor_num_gpus_per_node": 8},
        "data": {"rollout_batch_size": 4, "n_samples_per_prompt": 4}})


def test_a_long_sample_is_split_over_the_context_parallel_ranks():
    size = ModelSize.from_hf(LLAMA_70B)
    one, four = (memory.micro_batch_tokens(long_config(context_parallel_size=cp)) for cp in (1, 4))
    assert (one, four) == (32768, 8192)  # a 32k-token sample alone in a micro-batch, a quarter of it a rank
    assert memory.micro_batch_tokens(long_config(), memory.TrainerLayout.of(long_config())) == 32768
    estimates = [estimate_memory(long_config(context_parallel_size=cp), size, "cuda") for cp in (1, 4)]
    logits = 3 * (1 << 30)  # a 1 GiB chunk of fp32 logits, and the backward's two
    assert estimates[0].terms["activations"] - logits == pytest.approx(4 * (estimates[1].terms["activations"] - logits))


def test_the_distributed_optimizer_divides_adams_state_by_dp_times_cp():
    size = ModelSize.from_hf(LLAMA_70B)
    cfg = long_config(tensor_model_parallel_size=2, context_parallel_size=2)  # DP 2 x CP 2 on 8 GPUs
    layout = memory.TrainerLayout.of(cfg)
    assert layout.dp_cp == 4
    # (the setting's default is the Megatron trainer's: with core installed alone the layout cannot know it)
    sharded = estimate_memory(cfg, size, "cuda", layout=dataclasses.replace(layout, distributed_optimizer=True))
    plain = estimate_memory(cfg, size, "cuda", layout=dataclasses.replace(layout, distributed_optimizer=False))
    assert plain.terms["optimizer"] == pytest.approx(4 * sharded.terms["optimizer"], abs=4)
    assert plain.terms["gradients"] == sharded.terms["gradients"]  # the fp32 gradient buffer stays whole


def test_selective_recompute_of_the_mlp_drops_its_four_intermediate_tensors():
    size = ModelSize.from_hf(TINY)
    kwargs = dict(tokens=1000, tp=1, pp=1, sequence_parallel=False, dtype_bytes=2, device="cpu")
    none, mlp, attn = (activation_bytes(size, recompute=r, **kwargs) for r in (False, ["mlp"], ["core_attn"]))
    assert none - mlp == 1000 * 2 * 2 * 4 * 128  # tokens x bytes x layers x 4 I
    assert attn == none  # flash attention keeps no scores: nothing to drop in this estimate


def test_the_engine_estimate_is_weights_and_the_kv_cache_left():
    size = ModelSize.from_hf(LLAMA_70B)
    cfg = Config.model_validate({"rollout": {"max_response_len": 8192}, "cluster": {"rollout_num_gpus_per_engine": 8}})
    cfg.rollout.engine = "sglang"
    engine = memory.engine_estimate(cfg, size, "cuda")
    assert engine.weights == size.total_params * 2 // 8  # bf16, an eighth per GPU
    assert engine.kv_bytes_per_token == 2 * 80 * 1 * 128 * 2  # K and V, 80 layers, 8 KV heads / 8, bf16
    assert engine.context_len == 8192 and engine.static_fraction == memory.SGLANG_STATIC_FRACTION
    assert memory.engine_estimate(cfg, size, "cpu") is None
