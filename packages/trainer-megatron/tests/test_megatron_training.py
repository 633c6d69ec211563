"""What a user relies on from train_step: GRPO and SFT learn, micro-batching does not change the
update, checkpoints resume bit for bit, the reference model stays put, the critic fits returns."""

from __future__ import annotations

import pytest
import torch
from megatron_testlib import (
    ensure_single_rank_group,
    hf_response_log_probs,
    launch,
    load_hf,
    make_config,
    make_hf_model,
    make_samples,
    per_sample,
    to_batch,
    trainer_for,
)
from megatron_worker import run_scenario

from slime_rl.core.algorithms import losses
from slime_rl.core.algorithms.advantages import compute_advantages
from slime_rl.core.batch import RolloutBatch
from slime_rl.core.sample import Sample

VOCAB = 256


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("policy") / "m", "qwen2", tie=True, vocab=VOCAB)


def surrogate(cfg, batch, log_probs) -> float:
    """The GRPO/PPO loss of ``log_probs`` against the batch's old log-probs and advantages."""
    inputs = losses.LossBatch(
        log_probs=batch.padded(log_probs), old_log_probs=batch.padded(batch.old_log_probs),
        advantages=batch.padded(batch.advantages), loss_mask=batch.padded(batch.loss_mask))
    loss, _ = losses.compute_loss(cfg.algorithm, inputs, eps_clip_high=cfg.eps_clip_high,
                                  num_tokens=float(batch.loss_mask.sum()), num_seqs=len(batch))
    return float(loss)


def test_grpo_step_with_real_advantages_lowers_the_loss(model_dir):
    trainer = trainer_for(model_dir, ["trainer.lr=0.002"])
    samples = make_samples(16, VOCAB, seed=3)
    for k, s in enumerate(samples):  # 4 prompts x 4 samples; reward: share of "low" token ids
        s.group_index = k // 4
        s.reward = sum(t < VOCAB // 2 for t in s.response_tokens) / s.response_length
    batch = to_batch(samples)
    compute_advantages(batch, trainer.cfg.algorithm, n_samples_per_prompt=4)
    assert (batch.advantages != 0).any()
    before = trainer.compute_log_probs(batch)
    assert before.dtype == torch.float32 and before.shape == (batch.num_response_tokens,)
    batch.old_log_probs = before
    metrics = trainer.train_step(batch)
    assert metrics["grad_norm"] > 0 and metrics["update_skipped"] == 0
    after = trainer.compute_log_probs(batch)
    assert surrogate(trainer.cfg, batch, before) == pytest.approx(metrics["loss"], abs=1e-6)
    assert surrogate(trainer.cfg, batch, after) < surrogate(trainer.cfg, batch, before) - 1e-3
    # and the rewarded tokens became more likely
    gain = float((batch.advantages.double() * (after.double() - before.double())).sum())
    assert gain > 0


def test_sft_drives_the_nll_down(tmp_path):
    """A copy task: the response repeats the prompt."""
    model_dir = make_hf_model(tmp_path / "m", "llama", vocab=64, hidden=64)
    trainer = trainer_for(model_dir, ["algorithm.loss_type=sft", "trainer.lr=0.003", "trainer.micro_batch_size=8"])
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(16):
        prompt = torch.randint(0, 64, (5,), generator=g).tolist()
        samples.append(Sample(index=i, tokens=prompt + prompt, response_length=5, loss_mask=[1] * 5,
                              rollout_log_probs=[0.0] * 5, reward=0.0))
    batch = to_batch(samples)

    def nll():
        return -float(trainer.compute_log_probs(batch).double().mean())

    start = nll()
    for _ in range(25):
        metrics = trainer.train_step(batch)
    assert metrics["sft_loss"] == pytest.approx(metrics["loss"])
    assert nll() < 0.5 * start, (start, nll())


def test_micro_batching_and_recompute_do_not_change_the_update(model_dir):
    samples = make_samples(6, VOCAB)
    results = []
    for overrides in (["trainer.micro_batch_size=1"], ["trainer.micro_batch_size=6"],
                      ["trainer.max_tokens_per_gpu=25"], ["trainer.micro_batch_size=2", "trainer.megatron.recompute=true"],
                      ["trainer.micro_batch_size=3", "trainer.megatron.recompute=[mlp, core_attn]"]):
        trainer = trainer_for(model_dir, overrides)
        results.append([trainer.train_step(to_batch(samples)) for _ in range(2)])
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], abs=1e-6)


@pytest.mark.parametrize("correction", ["icepop", "seq-mask-tis"])
def test_a_rollout_correction_reports_the_whole_steps_metrics_however_it_is_micro_batched(model_dir, correction):
    """The engine's log-probs scattered around the trainer's: a step reports the shares masked, the ratio
    quantiles and the gap that compute_loss gives on the whole batch, one sample per micro-batch or packed,
    with the old log-probs given or taken from the training forward."""
    samples = make_samples(8, VOCAB, seed=5)
    old = trainer_for(model_dir).compute_log_probs(to_batch(samples))
    g = torch.Generator().manual_seed(0)
    sample_of_token = torch.arange(len(samples)).repeat_interleave(to_batch(samples).response_lengths)
    shifted = torch.isin(sample_of_token, torch.tensor([2, 5]))  # two samples far from the trainer's as a whole
    rollout = old - 0.3 * torch.randn(old.shape, generator=g) - 0.8 * shifted
    overrides = [f"algorithm.rollout_correction={correction}", "algorithm.rollout_correction_high=1.6"]

    def step(batching, given_old=True):
        batch = to_batch(samples)
        batch.rollout_log_probs = rollout
        if given_old:
            batch.old_log_probs = old
        return trainer_for(model_dir, overrides + batching).train_step(batch)

    batch = to_batch(samples)
    cfg = make_config(model_dir, overrides)
    inputs = losses.LossBatch(
        log_probs=batch.padded(old).double(), old_log_probs=batch.padded(old).double(),
        advantages=batch.padded(batch.advantages).double(), loss_mask=batch.padded(batch.loss_mask).double(),
        rollout_log_probs=batch.padded(rollout).double())
    _, whole = losses.compute_loss(cfg.algorithm, inputs, eps_clip_high=cfg.eps_clip_high,
                                   num_tokens=float(batch.loss_mask.sum()), num_seqs=len(batch))
    want = {k: v for k, v in losses.reduce_metrics([whole]).items() if k.startswith("rollout_corr_")}
    want["train_rollout_logprob_abs_diff"] = float(((old - rollout).abs() * batch.loss_mask).sum()
                                                   / batch.loss_mask.sum())
    assert 0 < want["rollout_corr_masked_frac"] < 0.6
    assert want["rollout_corr_masked_seq_frac"] == 2 / 8  # (icepop: every token of the shifted two)
    assert want["rollout_corr_ratio_p5"] < want["rollout_corr_ratio_p50"] < want["rollout_corr_ratio_p95"]
    assert len(want) == 11
    want["loss"] = float(whole["loss"])  # the step starts at the weights that gave ``old``
    runs = [step(["trainer.micro_batch_size=1"]), step(["trainer.micro_batch_size=8"]),
            step(["trainer.max_tokens_per_gpu=25"]), step(["trainer.micro_batch_size=3"], given_old=False)]
    for metrics in runs:
        assert metrics["update_skipped"] == 0
        for name, value in want.items():
            assert metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name


@pytest.mark.slow  # two trainer processes (~10 s on 2 cores)
def test_a_rollout_correction_over_two_data_parallel_ranks_reports_what_one_rank_does(model_dir, tmp_path):
    """Each rank holds half the step's tokens: the shares and quantiles are the whole step's all the same."""
    spec = dict(model=str(model_dir), num_samples=8, vocab=VOCAB, steps=2, rollout_scatter=True)
    overrides = ["algorithm.rollout_correction=seq-mask-tis", "algorithm.rollout_correction_high=1.6",
                 "trainer.micro_batch_size=2"]
    ensure_single_rank_group()
    single = run_scenario({**spec, "overrides": overrides})
    multi = launch(2, {**spec, "overrides": overrides + ["cluster.actor_num_gpus_per_node=2"]}, tmp_path)
    for one, two in zip(single["metrics"], multi["metrics"], strict=True):
        names = [n for n in one if n.startswith("rollout_corr_")] + ["loss", "train_rollout_logprob_abs_diff"]
        assert len(names) == 12 and 0 < one["rollout_corr_masked_seq_frac"] < 1
        for name in names:
            assert two[name] == pytest.approx(one[name], rel=1e-5, abs=1e-6), name


def test_a_rollout_of_several_global_batches_takes_several_optimizer_steps(model_dir):
    samples = make_samples(6, VOCAB)
    trainer = trainer_for(model_dir, ["trainer.global_batch_size=3"])
    whole = trainer.train_step(to_batch(samples, samples_per_step=trainer.cfg.global_batch_size))
    halves = trainer_for(model_dir, ["trainer.global_batch_size=3"])
    first, second = halves.train_step(to_batch(samples[:3])), halves.train_step(to_batch(samples[3:]))
    assert whole["optimizer_steps"] == 2
    assert whole["loss"] == pytest.approx((first["loss"] + second["loss"]) / 2, abs=1e-12)
    assert whole["grad_norm"] == pytest.approx((first["grad_norm"] + second["grad_norm"]) / 2, abs=1e-12)


def test_resume_replays_the_next_steps_bit_for_bit(model_dir, tmp_path):
    batch = to_batch(make_samples(6, VOCAB))
    overrides = ["trainer.lr_warmup_steps=2", "trainer.weight_decay=0.1", "algorithm.entropy_coef=0.01"]
    trainer = trainer_for(model_dir, overrides)
    for _ in range(2):
        trainer.train_step(batch)
    trainer.save(str(tmp_path / "ckpt"))
    uninterrupted = [trainer.train_step(batch) for _ in range(3)]
    weights = {n: t.clone() for b in trainer.named_weights(1 << 20) for n, t in b}

    resumed = trainer_for(model_dir, overrides)
    resumed.load(str(tmp_path / "ckpt"))
    assert [resumed.train_step(batch) for _ in range(3)] == uninterrupted
    assert all(torch.equal(t, weights[n]) for b in resumed.named_weights(1 << 20) for n, t in b)


def test_a_resume_trains_on_the_new_schedule_and_adam_settings(model_dir, tmp_path):
    """The config's lr, min_lr, warmup, decay, weight decay and Adam betas/eps win over the checkpoint's
    (run/resume_check.py says so before the run starts); the step count and Adam's moments come back."""
    batch = to_batch(make_samples(2, VOCAB))
    trainer = trainer_for(model_dir, ["trainer.lr=2e-5"])
    trainer.train_step(batch)
    trainer.save(str(tmp_path / "ckpt"))

    changed = ["trainer.lr=0.001", "trainer.min_lr=0.0001", "trainer.lr_warmup_steps=1", "data.num_rollout=4",
               "trainer.lr_decay_style=linear", "trainer.weight_decay=0.05", "trainer.adam_beta2=0.95",
               "trainer.adam_eps=1e-6"]
    resumed = trainer_for(model_dir, changed)
    resumed.load(str(tmp_path / "ckpt"))
    fresh = trainer_for(model_dir, changed)  # the new schedule from the start, one step in
    fresh.train_step(batch)
    assert [resumed.train_step(batch)["lr"] for _ in range(2)] == pytest.approx(
        [fresh.train_step(batch)["lr"] for _ in range(2)])
    assert resumed.scheduler.max_lr == 0.001 and resumed.scheduler.num_steps == 3
    for group in resumed.optimizer.param_groups:
        assert group["betas"] == (0.9, 0.95) and group["eps"] == 1e-6
        assert group["weight_decay"] == pytest.approx(0.05 * group.get("wd_mult", 1.0))


def test_learning_rate_warms_up_then_holds(model_dir):
    trainer = trainer_for(model_dir, ["trainer.lr=0.001", "trainer.lr_warmup_steps=2"])
    batch = to_batch(make_samples(2, VOCAB))
    assert [trainer.train_step(batch)["lr"] for _ in range(4)] == pytest.approx([0.0, 0.0005, 0.001, 0.001])


def test_cosine_decay_needs_the_number_of_steps(model_dir):
    with pytest.raises(ValueError, match="data.num_rollout"):
        trainer_for(model_dir, ["trainer.lr_decay_style=cosine"])


def test_reference_model_stays_at_its_weights(model_dir, tmp_path):
    samples = make_samples(4, VOCAB)
    batch = to_batch(samples)
    trainer = trainer_for(model_dir, ["algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=0.1",
                                      "trainer.lr=0.01"])
    initial = trainer.compute_log_probs(batch)
    batch.ref_log_probs = trainer.compute_log_probs(batch, model="ref")
    metrics = [trainer.train_step(batch) for _ in range(2)]
    assert metrics[0]["ref_kl"] == pytest.approx(0.0, abs=1e-9) and metrics[1]["ref_kl"] > 0
    assert torch.equal(trainer.compute_log_probs(batch, model="ref"), initial)
    assert not torch.equal(trainer.compute_log_probs(batch), initial)

    # a separate reference checkpoint (model.ref_path) is scored as transformers scores it
    other = make_hf_model(tmp_path / "ref", "qwen2", tie=True, vocab=VOCAB, seed=7)
    with_ref = trainer_for(model_dir, [f"model.ref_path={other}"])
    hf = load_hf(other)
    for s, lp in zip(samples, per_sample(batch, with_ref.compute_log_probs(batch, model="ref")), strict=True):
        assert torch.allclose(torch.tensor(lp), hf_response_log_probs(hf, s.tokens, s.response_length), atol=1e-4)

    plain = trainer_for(model_dir)
    with pytest.raises(ValueError, match="reference"):
        plain.compute_log_probs(batch, model="ref")


def test_critic_fits_the_returns(model_dir):
    critic = trainer_for(model_dir, ["trainer.critic_lr=0.01", "algorithm.value_clip=100"], role="critic")
    samples = make_samples(6, VOCAB)
    batch = to_batch(samples)
    values = critic.compute_values(batch)
    assert values.dtype == torch.float32
    assert [len(v) for v in per_sample(batch, values)] == [s.response_length for s in samples]
    assert (values == 0.0).all()  # the value head starts at zero
    batch.returns = torch.cat([torch.full((s.response_length,), 1.0 if k % 2 else -1.0)
                               for k, s in enumerate(samples)])

    def error():
        return float(((critic.compute_values(batch).double() - batch.returns.double()) ** 2).sum())

    start = error()
    for _ in range(15):
        batch.values = critic.compute_values(batch)
        metrics = critic.train_step(batch)
    assert "value_loss" in metrics and metrics["grad_norm"] > 0
    assert error() < 0.3 * start
    with pytest.raises(ValueError, match="critic"):
        critic.compute_log_probs(batch)
    critic.offload()  # host memory already on the CPU: nothing moves, training goes on
    critic.onload()
    critic.train_step(batch)


def test_bad_batches_get_one_line_errors(model_dir):
    trainer = trainer_for(model_dir)
    good = make_samples(2, VOCAB)
    no_adv = make_samples(2, VOCAB)
    for s in no_adv:
        s.advantages = []
    with pytest.raises(ValueError, match="advantages"):
        trainer.train_step(to_batch(no_adv))
    short = to_batch(good)
    short.advantages = short.advantages[:-1]
    with pytest.raises(ValueError, match=r"batch.advantages has \d+ entries for the shard's \d+ response tokens"):
        trainer.train_step(short)
    bad = make_samples(2, VOCAB)
    bad[1].loss_mask = bad[1].loss_mask[:-1]
    with pytest.raises(ValueError, match="loss_mask has"):
        RolloutBatch.from_samples(bad)
    empty = Sample(index=9, tokens=[1, 2, 3], response_length=0, reward=0.0)
    with pytest.raises(ValueError, match="response_length is 0"):
        trainer.compute_log_probs(to_batch([good[0], empty]))
    # a shard handed to the wrong data-parallel rank
    other = to_batch(good)
    other.dp_rank = 1
    with pytest.raises(ValueError, match="shard of data-parallel rank 1 on DP rank 0"):
        trainer.compute_log_probs(other)
    with pytest.raises(ValueError, match="shard of data-parallel rank 1 on DP rank 0"):
        trainer.train_step(other)


def test_sum_over_dp_with_one_rank_is_the_tensor_itself(model_dir):
    trainer = trainer_for(model_dir)
    x = torch.arange(3, dtype=torch.float64)
    assert trainer.data_parallel_rank == 0 and trainer.sum_over_dp(x) is x


def test_bf16_mixed_precision_trains_and_resumes_bit_for_bit(model_dir, tmp_path):
    """bf16 weights with fp32 master weights and grads (the GPU recipe, here on the CPU's AMX)."""
    batch = to_batch(make_samples(6, VOCAB))
    fp32 = trainer_for(model_dir).compute_log_probs(batch)
    overrides = ["model.dtype=bfloat16", "trainer.lr=0.002"]
    trainer = trainer_for(model_dir, overrides)
    assert next(trainer.model.parameters()).dtype == torch.bfloat16
    bf16 = trainer.compute_log_probs(batch)
    assert bf16.dtype == torch.float32 and float((fp32 - bf16).abs().max()) < 0.1
    batch.old_log_probs = bf16
    trainer.train_step(batch)
    trainer.save(str(tmp_path / "ckpt"))
    uninterrupted = [trainer.train_step(batch) for _ in range(2)]
    assert uninterrupted[1]["ppo_kl"] != 0  # the bf16 weights moved

    resumed = trainer_for(model_dir, overrides)
    resumed.load(str(tmp_path / "ckpt"))
    assert [resumed.train_step(batch) for _ in range(2)] == uninterrupted


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_reference_pass_leaves_training_untouched(model_dir, dtype):
    batch = to_batch(make_samples(6, VOCAB))
    overrides = [f"model.dtype={dtype}", "algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=0.1"]
    runs = []
    for ref_pass_first in (False, True):
        trainer = trainer_for(model_dir, overrides)
        if ref_pass_first:
            trainer.compute_log_probs(batch, model="ref")
        batch.ref_log_probs = torch.full((batch.num_response_tokens,), -1.0)
        runs.append([trainer.train_step(batch) for _ in range(2)])
    assert runs[0] == runs[1]


def test_staleness_token_weights_scale_each_tokens_loss(model_dir):
    """staleness_policy=downweight: RolloutBatch.token_weights multiply each token's loss; the
    denominator still counts whole tokens (core/staleness.py)."""
    trainer = trainer_for(model_dir)
    samples = make_samples(4, VOCAB, seed=5)
    for k, s in enumerate(samples):
        s.group_index, s.reward = k // 2, float(k % 2)
    batch = to_batch(samples)
    compute_advantages(batch, trainer.cfg.algorithm, n_samples_per_prompt=2)
    batch.old_log_probs = trainer.compute_log_probs(batch)
    batch.token_weights = torch.linspace(0.2, 1.0, batch.num_response_tokens)
    inputs = losses.LossBatch(
        log_probs=batch.padded(batch.old_log_probs), old_log_probs=batch.padded(batch.old_log_probs),
        advantages=batch.padded(batch.advantages),
        loss_mask=batch.padded(batch.loss_mask) * batch.padded(batch.token_weights))
    expected, _ = losses.compute_loss(trainer.cfg.algorithm, inputs, eps_clip_high=trainer.cfg.eps_clip_high,
                                      num_tokens=float(batch.loss_mask.sum()), num_seqs=len(batch))
    unweighted = surrogate(trainer.cfg, batch, batch.old_log_probs)
    metrics = trainer.train_step(batch)
    assert metrics["loss"] == pytest.approx(float(expected), abs=1e-6)
    assert float(expected) != pytest.approx(unweighted, abs=1e-4)
