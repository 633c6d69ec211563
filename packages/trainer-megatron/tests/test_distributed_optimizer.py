"""trainer.megatron.use_distributed_optimizer on two data-parallel ranks (gloo, fp32): Adam's state sharded
over the ranks gives the plain optimizer's steps (loss, grad norm, weights to fp32 rounding), resumes bit
for bit from its own checkpoint, refuses to resume a plain optimizer's checkpoint and the other way round
in one line naming the setting (megatron-core saves the two states differently), and survives having its
storages moved off and back (what offload does between phases on a GPU)."""

from __future__ import annotations

import pytest
import torch
from megatron_testlib import launch, make_hf_model

COMMON = ["algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=0.1", "algorithm.entropy_coef=0.01",
          "algorithm.eps_clip=0.1", "trainer.max_tokens_per_gpu=48", "cluster.actor_num_gpus_per_node=2"]
ON, OFF = "trainer.megatron.use_distributed_optimizer=true", "trainer.megatron.use_distributed_optimizer=false"


def assert_same_steps(plain: dict, sharded: dict) -> None:
    assert len(plain["metrics"]) == len(sharded["metrics"]) == 3
    for one, two in zip(plain["metrics"], sharded["metrics"], strict=True):
        assert abs(one["loss"] - two["loss"]) <= 1e-6, (one, two)
        assert abs(one["grad_norm"] - two["grad_norm"]) <= 1e-6 * max(1.0, one["grad_norm"]), (one, two)
    assert sharded["metrics"][2]["ppo_kl"] != 0  # the steps moved the policy
    assert sorted(plain["final"]) == sorted(sharded["final"])
    for name, weight in plain["final"].items():
        assert torch.allclose(weight, sharded["final"][name], atol=1e-6, rtol=1e-6), name


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # an untied LM head and qk-norm: every kind of parameter the sharded state must cover
    return make_hf_model(tmp_path_factory.mktemp("model") / "qwen3", "qwen3", tie=False, vocab=256)


def run(tmp_path, model, name: str, overrides: list[str], **spec) -> dict:
    spec = dict(model=str(model), num_samples=6, vocab=256, ref=True, steps=3, overrides=COMMON + overrides,
                ckpt=str(tmp_path / f"ckpt-{name}"), **spec)
    return launch(2, spec, tmp_path)


def test_sharded_adam_matches_the_plain_optimizer_and_resumes_bit_exact(tmp_path, model):
    plain = run(tmp_path, model, "plain", [OFF], save_after=1)
    sharded = run(tmp_path, model, "sharded", [ON], save_after=1)
    assert_same_steps(plain, sharded)
    for result in (plain, sharded):  # steps 2 and 3 replayed from the checkpoint, bit for bit
        assert result["resumed_metrics"] == result["metrics"][1:]
        assert all(torch.equal(t, result["resumed_final"][n]) for n, t in result["final"].items())


@pytest.mark.parametrize(("saved", "resumed"), [(OFF, ON), (ON, OFF)])
def test_a_checkpoint_refuses_a_resume_with_the_setting_switched(tmp_path, model, saved, resumed):
    with pytest.raises(AssertionError) as err:  # the ranks' logs
        run(tmp_path, model, "switch", [saved], save_after=1, resume_overrides=COMMON + [resumed])
    assert f"optimizer's state; resume with {saved}" in str(err.value)


def test_storages_moved_off_and_back_keep_the_sharded_state(tmp_path, model):
    plain = run(tmp_path, model, "plain", [OFF])
    moved = run(tmp_path, model, "moved", [ON], offload_before=1)
    assert_same_steps(plain, moved)
