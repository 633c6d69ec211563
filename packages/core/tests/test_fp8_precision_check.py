"""rollout.precision / rollout.kv_cache_dtype refused before anything starts where FP8 cannot be served
(config/precision.py): the CPU, an engine without FP8 kernels (hf), and delta syncs of FP8 weights."""

from __future__ import annotations

import pytest

from slime_rl.core.config import Config, ConfigError
from slime_rl.core.config.precision import check_precision


def cfg(**rollout) -> Config:
    return Config.model_validate({"model": {"path": "/models/m"}, "rollout": {"engine": "sglang", **rollout},
                                  "cluster": {"device": "cuda"}})


def test_the_model_dtype_is_never_refused():
    check_precision(cfg(engine="hf"), "cpu")


@pytest.mark.parametrize("field, rollout", [("rollout.precision", {"precision": "fp8"}),
                                            ("rollout.kv_cache_dtype", {"kv_cache_dtype": "fp8_e4m3"})])
def test_fp8_on_the_cpu_or_the_hf_engine_is_refused_with_the_reason(field, rollout):
    with pytest.raises(ConfigError, match=f"{field}: FP8 rollouts need GPUs of compute capability 8.9 or above .*"
                                          "this run's device is cpu"):
        check_precision(cfg(**rollout), "cpu")
    # the engines' own settings say what they serve: with core alone installed neither engine is there to ask
    pytest.importorskip("slime_rl.rollout_sglang", reason="the engines' FP8 support: slime-rl-rollout-sglang")
    pytest.importorskip("slime_rl.rollout_hf", reason="the engines' FP8 support: slime-rl-rollout-hf")
    check_precision(cfg(**rollout), "cuda")
    with pytest.raises(ConfigError, match=f"{field}: rollout.engine=hf serves weights and KV cache in the model's"
                                          " dtype only .* use rollout.engine=sglang"):
        check_precision(cfg(engine="hf", **rollout), "cuda")


def test_delta_syncs_of_fp8_weights_are_refused():
    pytest.importorskip("slime_rl.rollout_sglang", reason="SGLang's settings declare its FP8 support")
    with pytest.raises(ConfigError, match="rollout.update_weight_mode: delta syncs .* set rollout.update_weight_mode"
                                          "=full"):
        check_precision(cfg(precision="fp8", update_weight_mode="delta"), "cuda")
    check_precision(cfg(kv_cache_dtype="fp8_e4m3", update_weight_mode="delta"), "cuda")  # the KV cache alone is fine


def test_the_engine_memory_estimate_counts_fp8_weights_and_kv_cache_at_a_byte():
    from slime_rl.core.config import memory
    from slime_rl.core.config.memory import ModelSize

    size = ModelSize.from_hf({"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                              "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                              "tie_word_embeddings": False})  # Qwen2.5-7B
    bf16 = memory.engine_estimate(cfg(), size, "cuda")
    fp8 = memory.engine_estimate(cfg(precision="fp8"), size, "cuda")
    kv = memory.engine_estimate(cfg(precision="fp8", kv_cache_dtype="fp8_e4m3"), size, "cuda")
    embeddings = 2 * 152064 * 3584  # embed_tokens and lm_head stay bf16
    assert bf16.weights == size.total_params * 2
    assert fp8.weights == embeddings * 2 + (size.total_params - embeddings)
    assert fp8.kv_bytes_per_token == bf16.kv_bytes_per_token == 2 * kv.kv_bytes_per_token
    assert fp8.kv_cache(80 * 2**30) > bf16.kv_cache(80 * 2**30)  # the bytes FP8 saves go to the KV cache


def test_a_model_no_fp8_block_divides_or_already_quantised_is_refused_at_plan(tmp_path):
    pytest.importorskip("slime_rl.rollout_sglang", reason="SGLang's settings declare its FP8 support")
    import json

    shape = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536}
    (tmp_path / "config.json").write_text(json.dumps(shape))  # SmolLM2-135M: 64x64 blocks
    check_precision(Config.model_validate({"model": {"path": str(tmp_path)}, "cluster": {"device": "cuda"},
                                           "rollout": {"engine": "sglang", "precision": "fp8"}}), "cuda")
    (tmp_path / "config.json").write_text(json.dumps({**shape, "hidden_size": 584}))
    fp8 = Config.model_validate({"model": {"path": str(tmp_path)}, "rollout": {"engine": "sglang", "precision": "fp8"}})
    with pytest.raises(ConfigError, match=r"rollout.precision: no FP8 block edge of 128, 64, 32, 16 divides the"
                                          r" model's partitions \[584, "):
        check_precision(fp8, "cuda")
    (tmp_path / "config.json").write_text(json.dumps({**shape, "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(ConfigError, match="config.json is already quantised"):
        check_precision(fp8, "cuda")
