"""Advantage estimators against hand-worked values, and their invariants."""

import math
import statistics

import pytest
import torch

from slime_rl.core.algorithms import advantages as advantages_module
from slime_rl.core.algorithms.advantages import (
    discounted_returns,
    dr_grpo_advantages,
    gae,
    grpo_advantages,
    rloo_advantages,
    whiten,
)
from slime_rl.core.batch import RolloutBatch
from slime_rl.core.config import AlgorithmConfig
from slime_rl.core.sample import Sample

torch.set_num_threads(1)


def make_sample(index, group, reward, length, *, loss_mask=None, old=None, ref=None, values=None):
    return Sample(
        index=index, group_index=group, reward=reward, response_length=length, tokens=[0] * length,
        loss_mask=loss_mask if loss_mask is not None else [1] * length,
        old_log_probs=old or [], ref_log_probs=ref or [], values=values or [],
    )


def approx(values, rel=1e-9, abs=1e-9):
    return pytest.approx(values, rel=rel, abs=abs)


def compute_advantages(samples, algo, *, n_samples_per_prompt, reward_key=None):
    """The trainer side's computation on one shard holding ``samples``, written back to the samples.
    The batch stores advantages in float32 (what the trainer trains with): compared to 1e-6 here."""
    for s in samples:
        s.rollout_log_probs = s.rollout_log_probs or [0.0] * s.response_length
    batch = RolloutBatch.from_samples(samples, reward_key=reward_key)
    for name in ("old_log_probs", "ref_log_probs", "values"):
        if any(getattr(s, name) for s in samples):
            setattr(batch, name, torch.tensor([x for s in samples for x in getattr(s, name)], dtype=torch.float32))
    advantages_module.compute_advantages(batch, algo, n_samples_per_prompt=n_samples_per_prompt)
    ends = batch.response_offsets().tolist()
    for i, s in enumerate(samples):
        s.advantages = batch.advantages[ends[i] : ends[i + 1]].double().tolist()
        s.returns = batch.returns[ends[i] : ends[i + 1]].double().tolist() if batch.returns is not None else []


def approx32(values):
    return pytest.approx(values, rel=1e-6, abs=1e-6)


# ---------------------------------------------------------------- group estimators


def test_grpo_group_of_four_by_hand():
    # mean 0.5, unbiased std sqrt((4 * 0.25) / 3) = sqrt(1/3)
    adv = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]], dtype=torch.float64), normalize_std=True)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert adv[0].tolist() == approx([a, -a, -a, a])


def test_grpo_two_groups_constant_group_gets_zero():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0]], dtype=torch.float64)
    adv = grpo_advantages(rewards, normalize_std=True)
    std = math.sqrt((0.75**2 + 3 * 0.25**2) / 3)
    assert adv[0].tolist() == approx([0.75 / (std + 1e-6)] + [-0.25 / (std + 1e-6)] * 3)
    assert adv[1].tolist() == [0.0] * 4


def test_grpo_invariants_mean_zero_std_one():
    rewards = torch.rand(5, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    adv = grpo_advantages(rewards, normalize_std=True, eps=0.0)
    torch.testing.assert_close(adv.mean(-1), torch.zeros(5, dtype=torch.float64))
    torch.testing.assert_close(adv.std(-1), torch.ones(5, dtype=torch.float64))
    plain = grpo_advantages(rewards, normalize_std=False)
    torch.testing.assert_close(plain.mean(-1), torch.zeros(5, dtype=torch.float64))
    torch.testing.assert_close(plain, rewards - rewards.mean(-1, keepdim=True))


def test_grpo_huge_finite_rewards_do_not_overflow_the_group_variance():
    # (1e160)**2 overflows float64: the plain std was inf and both advantages 0
    adv = grpo_advantages(torch.tensor([[1e160, 0.0], [0.0, -1e300]], dtype=torch.float64), normalize_std=True)
    a = 0.5 / math.sqrt(0.5)
    assert adv.flatten().tolist() == approx([a, -a, a, -a])
    assert grpo_advantages(torch.tensor([[1e308, 1e308]], dtype=torch.float64), normalize_std=False).tolist() == [[0, 0]]


def test_grpo_one_sample_per_prompt_skips_std():
    adv = grpo_advantages(torch.tensor([[3.0], [1.0]]), normalize_std=True)
    assert adv.tolist() == [[0.0], [0.0]]  # no NaN from the std of one value


def test_dr_grpo_and_rloo_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    assert dr_grpo_advantages(rewards)[0].tolist() == approx([0.75, -0.25, -0.25, -0.25])
    # leave-one-out: r_i - mean of the other three
    assert rloo_advantages(rewards)[0].tolist() == approx([1.0, -1 / 3, -1 / 3, -1 / 3])
    with pytest.raises(ValueError, match="n_samples_per_prompt >= 2"):
        rloo_advantages(torch.ones(2, 1))


@pytest.mark.parametrize("estimator", ["grpo", "gspo"])
def test_compute_advantages_grpo_padded_and_masked(estimator):
    # two groups of two, different lengths, a tool token (loss_mask 0) in sample 1
    samples = [
        make_sample(0, 0, 1.0, 3),
        make_sample(1, 0, 0.0, 2, loss_mask=[1, 0]),
        make_sample(2, 1, 0.5, 1),
        make_sample(3, 1, 0.5, 4),
    ]
    compute_advantages(samples, AlgorithmConfig(advantage_estimator=estimator), n_samples_per_prompt=2)
    a = 0.5 / (math.sqrt(0.5) + 1e-6)  # mean 0.5, unbiased std of (1, 0) = sqrt(0.5)
    assert samples[0].advantages == approx32([a, a, a])
    assert samples[1].advantages == approx32([-a, 0.0])
    assert samples[2].advantages == [0.0]
    assert samples[3].advantages == [0.0] * 4
    assert all(s.returns == [] for s in samples)


def test_compute_advantages_std_off_and_rloo_and_dict_reward():
    samples = [make_sample(i, 0, {"acc": r, "len": 9.0}, 2) for i, r in enumerate([1.0, 0.0, 0.0, 0.0])]
    compute_advantages(samples, AlgorithmConfig(grpo_std_normalization=False), n_samples_per_prompt=4,
                       reward_key="acc")
    assert [a for s in samples for a in s.advantages] == approx32([0.75] * 2 + [-0.25] * 6)
    compute_advantages(samples, AlgorithmConfig(advantage_estimator="rloo"), n_samples_per_prompt=4,
                       reward_key="acc")
    assert [s.advantages[0] for s in samples] == approx32([1.0, -1 / 3, -1 / 3, -1 / 3])
    with pytest.raises(ValueError, match="reward_key"):
        compute_advantages(samples, AlgorithmConfig(), n_samples_per_prompt=4)


def test_kl_coef_penalises_the_sequence_reward_of_group_estimators():
    # kl = old - ref summed over trained tokens: sample 0: 0.2 + 0.4 = 0.6 (the masked 5.0 is not counted)
    samples = [
        make_sample(0, 0, 1.0, 3, loss_mask=[1, 1, 0], old=[-1.0, -1.0, 0.0], ref=[-1.2, -1.4, -5.0]),
        make_sample(1, 0, 1.0, 2, old=[-1.0, -1.0], ref=[-1.0, -1.0]),
    ]
    compute_advantages(samples, AlgorithmConfig(advantage_estimator="dr_grpo", kl_coef=0.5), n_samples_per_prompt=2)
    # penalised rewards 0.7 and 1.0, mean 0.85
    assert samples[0].advantages == approx32([-0.15, -0.15, 0.0])
    assert samples[1].advantages == approx32([0.15, 0.15])


def test_normalize_advantages_whitens_over_trained_tokens():
    samples = [make_sample(i, i // 2, r, n, loss_mask=m) for i, (r, n, m) in
               enumerate([(1.0, 3, [1, 1, 1]), (0.0, 2, [1, 0]), (0.2, 4, [1, 1, 1, 1]), (0.9, 1, [1])])]
    compute_advantages(samples, AlgorithmConfig(normalize_advantages=True), n_samples_per_prompt=2)
    trained = [a for s in samples for a, m in zip(s.advantages, s.loss_mask, strict=True) if m]
    assert statistics.fmean(trained) == pytest.approx(0.0, abs=1e-6)
    assert statistics.stdev(trained) == pytest.approx(1.0, abs=1e-6)
    assert samples[1].advantages[1] == 0.0


# ---------------------------------------------------------------- REINFORCE++


def test_discounted_returns_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 2.0], [3.0, 7.0, 0.0]], dtype=torch.float64)
    valid = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    out = discounted_returns(rewards, valid, gamma=0.5)
    assert out[0].tolist() == approx([1 + 0.5 * (0 + 0.5 * 2), 0 + 0.5 * 2, 2.0])
    assert out[1].tolist() == [3.0, 0.0, 0.0]  # 7.0 sits on padding


def test_reinforce_plus_plus_by_hand():
    # kl_coef 0.5, gamma 0.9. Sample A: kl = (0.1, -0.1, 0.2), reward 1 on its last token.
    # token rewards (-0.05, 0.05, 0.9): G2 = 0.9, G1 = 0.05 + 0.81 = 0.86, G0 = -0.05 + 0.774 = 0.724
    # Sample B: loss_mask (1, 0): reward 0 on token 0, its kl (0.2) charged, token 1 not trained.
    a = make_sample(0, 0, 1.0, 3, old=[-0.9, -1.1, -0.8], ref=[-1.0, -1.0, -1.0])
    b = make_sample(1, 1, 0.0, 2, loss_mask=[1, 0], old=[-0.8, -3.0], ref=[-1.0, -1.0])
    algo = AlgorithmConfig(advantage_estimator="reinforce_plus_plus", kl_coef=0.5, gamma=0.9)
    compute_advantages([a, b], algo, n_samples_per_prompt=1)
    raw = [0.724, 0.86, 0.9, -0.1]  # trained tokens, whitened together
    mean, std = statistics.fmean(raw), statistics.stdev(raw)
    white = [(x - mean) / math.sqrt(std**2 + 1e-8) for x in raw]
    assert a.advantages == approx32(white[:3])
    assert b.advantages == approx32([white[3], 0.0])


def test_reinforce_plus_plus_without_ref_has_no_kl():
    a, b = make_sample(0, 0, 1.0, 2), make_sample(1, 1, 0.0, 2)
    compute_advantages([a, b], AlgorithmConfig(advantage_estimator="reinforce_plus_plus", kl_coef=1.0),
                       n_samples_per_prompt=1)
    raw = [1.0, 1.0, 0.0, 0.0]
    s = statistics.stdev(raw)
    assert a.advantages + b.advantages == approx32([0.5 / s, 0.5 / s, -0.5 / s, -0.5 / s])


def test_reinforce_plus_plus_baseline_by_hand():
    # group (1, 0): centered (0.5, -0.5); kl_coef 1 subtracts per-token kl; then whitening
    a = make_sample(0, 0, 1.0, 2, old=[-1.0, -1.0], ref=[-1.2, -1.0])
    b = make_sample(1, 0, 0.0, 2, old=[-1.0, -1.0], ref=[-1.0, -0.9])
    algo = AlgorithmConfig(advantage_estimator="reinforce_plus_plus_baseline", kl_coef=1.0)
    compute_advantages([a, b], algo, n_samples_per_prompt=2)
    raw = [0.5 - 0.2, 0.5, -0.5, -0.5 + 0.1]
    mean, std = statistics.fmean(raw), statistics.stdev(raw)
    assert a.advantages + b.advantages == approx32([(x - mean) / math.sqrt(std**2 + 1e-8) for x in raw])


# ---------------------------------------------------------------- PPO / GAE


def test_gae_three_steps_by_hand():
    # gamma 0.9, lambda 0.8; rewards (0, 0, 1); values (0.5, 0.6, 0.7)
    # d2 = 1 - 0.7 = 0.3;            A2 = 0.3
    # d1 = 0.9*0.7 - 0.6 = 0.03;     A1 = 0.03 + 0.72*0.3 = 0.246
    # d0 = 0.9*0.6 - 0.5 = 0.04;     A0 = 0.04 + 0.72*0.246 = 0.21712
    rewards = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.6, 0.7]], dtype=torch.float64)
    adv, ret = gae(rewards, values, torch.ones_like(rewards), gamma=0.9, lambd=0.8)
    assert adv[0].tolist() == approx([0.21712, 0.246, 0.3])
    assert ret[0].tolist() == approx([0.71712, 0.846, 1.0])


def test_ppo_compute_advantages_padded_batch():
    long = make_sample(0, 0, 1.0, 3, values=[0.5, 0.6, 0.7])
    short = make_sample(1, 1, 2.0, 1, values=[0.5])  # padded to 3 inside; must not see the padding
    algo = AlgorithmConfig(advantage_estimator="ppo", gamma=0.9, lambd=0.8)
    compute_advantages([long, short], algo, n_samples_per_prompt=1)
    assert long.advantages == approx32([0.21712, 0.246, 0.3])
    assert long.returns == approx32([0.71712, 0.846, 1.0])
    assert short.advantages == approx32([1.5]) and short.returns == approx32([2.0])


def test_ppo_reward_goes_on_last_trained_token_and_needs_values():
    s = make_sample(0, 0, 1.0, 3, loss_mask=[1, 1, 0], values=[0.0, 0.0, 0.0])
    compute_advantages([s], AlgorithmConfig(advantage_estimator="ppo"), n_samples_per_prompt=1)
    assert s.advantages == approx32([1.0, 1.0, 0.0])
    assert s.returns == approx32([1.0, 1.0, 0.0])
    with pytest.raises(ValueError, match="ppo needs critic values"):
        compute_advantages([make_sample(0, 0, 1.0, 2)], AlgorithmConfig(advantage_estimator="ppo"),
                           n_samples_per_prompt=1)


def test_whiten_masked():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, -50.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    out = whiten(x, mask, eps=0.0)
    kept = out[mask > 0]
    assert kept.tolist() == approx([(v - 2.5) / statistics.stdev([1, 2, 3, 4]) for v in [1, 2, 3, 4]])


# ---------------------------------------------------------------- bad input


def test_groups_must_be_consecutive_runs():
    samples = [make_sample(i, g, 1.0, 1) for i, g in enumerate([0, 1, 0, 1])]
    with pytest.raises(ValueError, match="group_index"):
        compute_advantages(samples, AlgorithmConfig(), n_samples_per_prompt=2)
    with pytest.raises(ValueError, match="groups of n_samples_per_prompt=3"):
        compute_advantages(samples, AlgorithmConfig(), n_samples_per_prompt=3)


def test_per_token_lengths_checked():
    bad = make_sample(0, 0, 1.0, 3, loss_mask=[1, 1])
    with pytest.raises(ValueError, match="sample 0: loss_mask has 2 entries for 3"):
        compute_advantages([bad], AlgorithmConfig(), n_samples_per_prompt=1)
    with pytest.raises(ValueError, match="ref_log_probs has 2 entries for the batch's 3 response tokens"):
        compute_advantages([make_sample(0, 0, 1.0, 1, old=[0.0], ref=[0.0]),
                            make_sample(1, 0, 1.0, 2, old=[0.0, 0.0], ref=[0.0])],
                           AlgorithmConfig(), n_samples_per_prompt=2)


def test_empty_loss_mask_trains_every_token():
    samples = [make_sample(0, 0, 1.0, 2, loss_mask=[]), make_sample(1, 0, 0.0, 3, loss_mask=[])]
    compute_advantages(samples, AlgorithmConfig(advantage_estimator="dr_grpo"), n_samples_per_prompt=2)
    assert samples[0].advantages == [0.5, 0.5] and samples[1].advantages == [-0.5] * 3
