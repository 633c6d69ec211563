"""`slime-cli plan --gpu-memory`: a long-sample config's memory per trainer rank and per SGLang engine GPU,
compared with GPUs this machine does not have; a 128k-token config that cannot fit is refused in one line
that names the change that makes it fit (issue 36, item 3)."""

from __future__ import annotations

import pytest
from plan_inputs import qwen_7b_and_prompts
from typer.testing import CliRunner

from slime_rl.cli.app import app

H200 = "139.8"


@pytest.fixture
def plan(tmp_path):
    model, prompts = qwen_7b_and_prompts(tmp_path, max_position_embeddings=131072)
    config = tmp_path / "long.yaml"
    config.write_text(
        f"model: {{path: {model}}}\ndata: {{prompt_data: {prompts}, rollout_batch_size: 8, n_samples_per_prompt: 8}}\n"
        "rollout: {engine: sglang, max_prompt_len: 4096, max_response_len: 126976}\n"
        "cluster: {device: cuda, actor_num_gpus_per_node: 8}\n")

    def run(*overrides: str, gpu: str = H200):
        return CliRunner().invoke(app, ["plan", str(config), *overrides, "--gpu-memory", gpu])

    return run


def test_a_128k_token_config_that_cannot_fit_is_refused_naming_the_fix(plan):
    result = plan()
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith("error: model.path: ") and " does not fit: about " in line
    assert "139.8 GiB on each GPU (--gpu-memory)" in line and "at 131,072-token samples it fits with" in line
    # one 131,072-token sample a rank keeps ~675 GiB of activations; full recompute keeps a layer's input each
    assert "activations 675.0 GiB" in line
    assert "trainer.megatron.recompute=true (about 104.7 GiB)" in line
    assert "parallel.context_parallel_size=16" in line

    fixed = plan("trainer.megatron.recompute=true")
    assert fixed.exit_code == 0, fixed.output
    lines = fixed.stdout.splitlines()
    trainer = next(x for x in lines if x.startswith("memory per trainer rank: about 104.7 GiB"))
    assert "against 139.8 GiB a rank" in trainer and "micro-batches of 131,072 tokens a rank" in trainer
    assert "distributed optimizer on" in trainer  # the default: Adam's state / 8 data-parallel ranks
    engine = next(x for x in lines if x.startswith("memory per SGLang engine GPU:"))
    # 7.6B parameters in bf16; KV of 2 x 28 layers x 4 KV heads x 128 x 2 bytes = 56 KiB a token
    assert "weights 14.2 GiB" in engine and "samples of 131,072 tokens at once" in engine


def test_when_no_single_change_fits_the_combination_is_named(plan):
    result = plan("trainer.megatron.use_distributed_optimizer=false", gpu="80")
    assert result.exit_code == 2, result.output
    [line] = result.stderr.splitlines()
    assert "it fits with all of trainer.megatron.use_distributed_optimizer=true + trainer.megatron.recompute=true" in line


def test_an_engine_whose_kv_cache_cannot_hold_one_sample_is_refused(plan):
    result = plan("trainer.megatron.recompute=true", "rollout.sglang.server_args={mem_fraction_static: 0.15}")
    assert result.exit_code == 2, result.output
    [line] = result.stderr.splitlines()
    assert line.startswith("error: rollout.max_response_len: one sample of 131,072 tokens does not fit an SGLang engine")
    assert "cluster.rollout_num_gpus_per_engine" in line and "mem_fraction_static 0.15" in line

