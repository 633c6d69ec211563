"""A nan or inf never reaches the weights: a step whose loss or gradient is not finite is skipped
(counted) or stops the run (trainer.on_nonfinite), and non-finite weights are never saved or loaded.
Megatron's fp32 and bf16 optimizers have no check of their own (only fp16's loss scaler does)."""

from __future__ import annotations

import json

import pytest
import torch
from megatron_testlib import (
    launch,
    make_hf_model,
    make_samples,
    to_batch,
    trainer_for,
)

from slime_rl.trainer_megatron.checkpointing import InProcessTorchDistSave, sharded_state
from slime_rl.trainer_megatron.optimizer import is_distributed, optimizer_tensors
from slime_rl.trainer_megatron.trainer import NonFiniteError

VOCAB = 256


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("policy") / "m", "qwen2", tie=True, vocab=VOCAB)


def state_of(trainer) -> dict[str, torch.Tensor]:
    """Weights, the fp32 main copies and Adam moments, and the LR schedule's position."""
    state = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    state.update({f"opt{i}": t.detach().clone() for i, t in enumerate(optimizer_tensors(trainer.optimizer))})
    state["schedule"] = torch.tensor(trainer.scheduler.num_steps)
    return state


def poisoned(samples, value: float):
    for s in samples:
        s.advantages = [value] * s.response_length
    return samples


def batch_of(seed: int, *, poison: float | None = None):
    samples = make_samples(4, VOCAB, seed=seed)
    return to_batch(poisoned(samples, poison) if poison is not None else samples)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nonfinite_step_is_skipped_whole_and_counted(model_dir, dtype, bad):
    trainer = trainer_for(model_dir, [f"model.dtype={dtype}"])
    good = trainer.train_step(batch_of(1))
    assert good["nonfinite_skipped"] == 0 and good["update_skipped"] == 0
    before = state_of(trainer)
    skipped = trainer.train_step(batch_of(2, poison=bad))
    assert skipped["nonfinite_skipped"] == 1 and skipped["update_skipped"] == 1
    after = state_of(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before), "a skipped step changed the trainer's state"
    # and training goes on from there, finite
    metrics = trainer.train_step(batch_of(3))
    assert metrics["nonfinite_skipped"] == 0 and metrics["grad_norm"] > 0
    assert all(torch.isfinite(t).all() for t in state_of(trainer).values())
    assert any(not torch.equal(before[k], t) for k, t in state_of(trainer).items())


def test_a_rollout_of_several_steps_counts_its_skipped_ones(model_dir):
    trainer = trainer_for(model_dir, ["trainer.global_batch_size=2"])
    samples = make_samples(6, VOCAB, seed=4)
    poisoned(samples[2:4], float("nan"))  # the second of three optimizer steps
    metrics = trainer.train_step(to_batch(samples, samples_per_step=trainer.cfg.global_batch_size))
    assert metrics["optimizer_steps"] == 3 and metrics["nonfinite_skipped"] == 1


def test_on_nonfinite_stop_fails_naming_the_step(model_dir):
    trainer = trainer_for(model_dir, ["trainer.on_nonfinite=stop"])
    trainer.train_step(batch_of(1))
    before = state_of(trainer)
    with pytest.raises(NonFiniteError, match=r"trainer.on_nonfinite=stop: optimizer step 2 \(actor\) has a"
                                             r" non-finite loss \(nan\); the update was not applied"):
        trainer.train_step(batch_of(2, poison=float("nan")))
    assert all(torch.equal(before[k], t) for k, t in state_of(trainer).items())


def test_a_nonfinite_gradient_with_a_finite_loss_is_caught(model_dir):
    """The loss is finite but backward overflows: a hook turns one gradient into inf."""
    trainer = trainer_for(model_dir, ["trainer.on_nonfinite=stop"])
    param = next(p for n, p in trainer.model.named_parameters() if "linear_fc1" in n)
    handle = param.register_hook(lambda g: g * float("inf"))
    try:
        with pytest.raises(NonFiniteError, match=r"non-finite gradient"):
            trainer.train_step(batch_of(1))
    finally:
        handle.remove()


def test_nonfinite_weights_are_never_saved_nor_loaded(model_dir, tmp_path):
    from megatron.core import dist_checkpointing

    trainer = trainer_for(model_dir)
    trainer.train_step(batch_of(1))
    name, param = next((n, p) for n, p in trainer.model.named_parameters() if "linear_qkv.weight" in n)
    with torch.no_grad():
        param[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match=rf"checkpoint: refusing to save {tmp_path / 'ckpt'}: nan or inf in"
                                             rf" {name} \(rank 0\)"):
        trainer.save(str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()

    # One written behind the trainer's back (an older slime-rl, another tool): refused at load.
    (tmp_path / "raw").mkdir()
    dist_checkpointing.save(sharded_state(trainer), str(tmp_path / "raw"), sharded_strategy=InProcessTorchDistSave())
    (tmp_path / "raw" / "slime_rl_trainer.json").write_text(json.dumps(
        {"role": "actor", "step": 1, "architecture": trainer.shape.architecture, "world_size": 1,
         "distributed_optimizer": is_distributed(trainer.optimizer)}))
    with pytest.raises(NonFiniteError, match=rf"checkpoint: {tmp_path / 'raw'}: nan or inf in {name} \(rank 0\)"):
        trainer_for(model_dir).load(str(tmp_path / "raw"))


def test_an_inf_gradient_on_one_rank_is_skipped_on_every_rank(model_dir, tmp_path):
    """TP=2: only rank 1's shard of a weight gets the inf; rank 0 must not step alone (the ranks
    would part ways, and the next collective would hang)."""
    out = launch(2, dict(scenario="nonfinite_on_one_rank", model=str(model_dir), num_samples=4, vocab=VOCAB,
                         overrides=["parallel.tensor_model_parallel_size=2", "cluster.actor_num_gpus_per_node=2"]),
                 tmp_path)
    assert [m["nonfinite_skipped"] for m in out["metrics"]] == [0.0, 1.0, 0.0]
    assert out["unchanged"] == [False, True, False]
