"""trainer.megatron (settings.py): the Megatron trainer's own keys, checked when the config loads."""

import warnings

import pytest

from slime_rl.core.config import ConfigError, RenamedKeyWarning, load_config
from slime_rl.core.infra.plugins import load_plugin
from slime_rl.trainer_megatron.settings import MegatronSettings


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"input": "1 + 1 =", "label": "2"}\n')
    return path


def load(prompts, *overrides):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return load_config(None, [f"data.prompt_data={prompts}", "cluster.device=cpu", *overrides])


def test_the_trainer_declares_the_model_its_settings_entry_point_names():
    assert load_plugin("slime_rl.trainers.settings", "megatron") is MegatronSettings
    assert load_plugin("slime_rl.trainers", "megatron").settings is MegatronSettings


def test_recompute_is_full_or_a_list_of_megatron_modules(prompts):
    assert load(prompts, "trainer.megatron.recompute=true").trainer.settings.recompute is True
    assert load(prompts, "trainer.megatron.recompute=[mlp, core_attn]").trainer.megatron.recompute == ["mlp", "core_attn"]
    # megatron-core's layernorm recompute needs TransformerEngine, which the local spec does not use
    with pytest.raises(ConfigError, match=r"^trainer.megatron.recompute: \['layernorm'\]: give true"):
        load(prompts, "trainer.megatron.recompute=[layernorm]")


def test_moe_keys_moved_from_trainer_with_a_notice(prompts):
    with pytest.warns(RenamedKeyWarning, match="^trainer.moe_aux_loss_coeff is now trainer.megatron.moe_aux_loss_coeff"):
        cfg = load_config(None, [f"data.prompt_data={prompts}", "trainer.moe_aux_loss_coeff=0.001"])
    assert cfg.trainer.megatron.moe_aux_loss_coeff == 0.001
    with pytest.raises(ConfigError, match="did you mean `trainer.megatron.moe_grouped_gemm`"):
        load(prompts, "trainer.megatron.moe_grouped_gem=false")
