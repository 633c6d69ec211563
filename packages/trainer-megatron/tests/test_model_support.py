"""Which checkpoints the Megatron trainer builds, said from config.json before anything starts: an unsupported
architecture is refused with the supported list (and the missing part where known), and a supported one with
a field the trainer does not handle names that field."""

from __future__ import annotations

import json

import pytest

from slime_rl.core.config import ConfigError
from slime_rl.core.testing import tiny_config
from slime_rl.trainer_megatron.settings import MegatronSettings
from slime_rl.trainer_megatron.support import SUPPORTED_ARCHITECTURES, architecture_family, model_support


def _config_folder(tmp_path, family: str, **fields):
    config = tiny_config(family, vocab_size=64)
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    config.save_pretrained(tmp_path)
    if fields:
        hf = json.loads((tmp_path / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({**hf, **fields}))
    return tmp_path


def test_architectures_map_to_families_and_the_rest_are_named():
    assert architecture_family({"architectures": ["Glm4MoeForCausalLM"]}) == "glm4_moe"
    assert architecture_family({"architectures": ["DeepseekV3ForCausalLM"]}) == "deepseek_v3"
    # a reward model's backbone: its own head is not the trainer's business
    assert architecture_family({"architectures": ["Qwen2ForSequenceClassification"], "model_type": "qwen2"}) == "qwen2"
    assert architecture_family({"architectures": ["DeepseekV2ForCausalLM"]}) == "deepseek_v2"
    with pytest.raises(ValueError) as err:
        architecture_family({"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32"})
    assert ("DeepseekV32ForCausalLM is not supported: the Megatron trainer lacks DeepSeek Sparse Attention"
            in str(err.value))
    assert str(err.value).endswith(", ".join(SUPPORTED_ARCHITECTURES))
    with pytest.raises(ValueError, match="GPT2LMHeadModel is not supported; the Megatron trainer handles LlamaForCausalLM"):
        architecture_family({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})


def test_the_config_check_refuses_an_unsupported_model_path(tmp_path):
    from megatron_testlib import make_config

    folder = _config_folder(tmp_path / "m", "glm4_moe")
    settings = MegatronSettings()
    settings.check(make_config(folder), "trainer.megatron")  # supported: nothing to say
    hf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf, "architectures": ["DeepseekV32ForCausalLM"],
                                                    "model_type": "deepseek_v32"}))
    with pytest.raises(ConfigError, match="model.path: .*DeepseekV32ForCausalLM is not supported"):
        settings.check(make_config(folder), "trainer.megatron")


def test_model_support_says_what_is_built_and_which_field_is_not(tmp_path):
    supported, lines = model_support(_config_folder(tmp_path / "glm", "glm4_moe", num_nextn_predict_layers=1))
    said = dict(lines)
    assert supported and said["architecture"] == "Glm4MoeForCausalLM: supported (family glm4_moe)"
    assert "sigmoid scores with the correction bias (frozen in training), 2 group(s)" in said["experts"]
    assert "the first 1 layer(s) dense; TP > 1 with parallel.sequence_parallel" in said["experts"]
    assert "not loaded (neither trained nor synced to engines)" in said["mtp"]

    supported, lines = model_support(_config_folder(tmp_path / "bad", "glm4_moe", norm_topk_prob=False))
    assert not supported and dict(lines)["config"] == "norm_topk_prob=false with sigmoid routing is not supported"
    supported, lines = model_support(_config_folder(tmp_path / "ds", "deepseek_v3"))
    said = dict(lines)
    assert supported and said["architecture"] == "DeepseekV3ForCausalLM: supported (family deepseek_v3)"
    assert said["attention"] == ("multi-head latent attention (q rank 24, kv rank 16, qk 12+8, v 10); TP > 1 with"
                                 " sequence parallelism, CP=1")
    supported, lines = model_support(_config_folder(tmp_path / "v2", "deepseek_v2", q_lora_rank=None))
    said = dict(lines)
    assert supported and said["architecture"] == "DeepseekV2ForCausalLM: supported (family deepseek_v2)"
    assert said["experts"].startswith("8 routed, top-2, softmax scores") and "q unprojected" in said["attention"]
    supported, lines = model_support(_config_folder(tmp_path / "v32", "glm4_moe", architectures=["DeepseekV32ForCausalLM"],
                                                    model_type="deepseek_v32"))
    assert not supported and "lacks DeepSeek Sparse Attention" in dict(lines)["architecture"]
    assert model_support(tmp_path / "nowhere")[0] is False
