"""`slime-cli plan` with FP8 rollouts (issue 38, docs/fp8.md): an SGLang config on GPUs plans, one that asks for
FP8 from the hf engine or on the CPU is refused in one line with the reason."""

from __future__ import annotations

import pytest
from plan_inputs import qwen_7b_and_prompts
from typer.testing import CliRunner

from slime_rl.cli.app import app


@pytest.fixture
def plan(tmp_path):
    model, prompts = qwen_7b_and_prompts(tmp_path, max_position_embeddings=32768)
    config = tmp_path / "fp8.yaml"
    config.write_text(f"model: {{path: {model}}}\ndata: {{prompt_data: {prompts}, rollout_batch_size: 8}}\n"
                      "rollout: {engine: sglang, precision: fp8}\ncluster: {device: cuda, actor_num_gpus_per_node: 8}\n")
    return lambda *overrides: CliRunner().invoke(app, ["plan", str(config), *overrides])


def test_fp8_on_sglang_gpus_plans(plan):
    result = plan("rollout.kv_cache_dtype=fp8_e4m3")
    assert result.exit_code == 0, result.output
    assert "precision: fp8" in result.stdout and "kv_cache_dtype: fp8_e4m3" in result.stdout


@pytest.mark.parametrize("overrides, reason", [
    (["rollout.engine=hf"], "rollout.precision: rollout.engine=hf serves weights and KV cache in the model's dtype"),
    (["cluster.device=cpu"], "rollout.precision: FP8 rollouts need GPUs of compute capability 8.9 or above"),
    (["rollout.precision=model", "rollout.kv_cache_dtype=fp8_e4m3", "rollout.engine=hf"],
     "rollout.kv_cache_dtype: rollout.engine=hf"),
])
def test_fp8_where_it_cannot_be_served_is_refused_with_the_reason(plan, overrides, reason):
    result = plan(*overrides)
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert reason in result.stderr
