"""DAPO's overlong handling (core/algorithms/overlong.py): the soft penalty against its formula in exact
arithmetic, the filter's effect on the loss tokens and the advantages, and the config check."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from slime_rl.core.algorithms.advantages import compute_advantages
from slime_rl.core.algorithms.overlong import apply_overlong, overlong_penalties
from slime_rl.core.batch import RolloutBatch
from slime_rl.core.config import AlgorithmConfig, ConfigError, load_config
from slime_rl.core.sample import Sample, SampleStatus


def dapo_penalty(length: int, max_len: int, buffer: int, factor: Fraction) -> Fraction:
    """DAPO's R_length (eq. 13) scaled by the factor, exactly: 0, then linear, then -factor at the limit."""
    expected = max_len - buffer
    if length <= expected:
        return Fraction(0)
    if length <= max_len:
        return Fraction(expected - length, buffer) * factor
    return -factor


@pytest.mark.parametrize(("max_len", "buffer", "factor"), [(100, 20, 1.0), (20480, 4096, 1.0), (65536, 8192, 0.5)])
def test_the_soft_penalty_is_dapos_formula_in_float64(max_len, buffer, factor):
    lengths = sorted({0, 1, max_len - buffer - 1, max_len - buffer, max_len - buffer + 1, max_len - buffer // 2,
                      max_len - 3, max_len - 1, max_len})
    got = overlong_penalties(torch.tensor(lengths), max_len, buffer, factor)
    assert got.dtype == torch.float64
    for length, value in zip(lengths, got.tolist(), strict=True):
        exact = dapo_penalty(length, max_len, buffer, Fraction(factor))
        assert abs(Fraction(value) - exact) <= Fraction(1, 2**50), (length, value, exact)
    assert got[0] == 0 and got[-1] == -factor and bool((got.diff() <= 0).all())  # monotone, 0 down to -factor


def sample(index: int, reward: float, length: int, status: SampleStatus) -> Sample:
    return Sample(index=index, group_index=0, tokens=[1, 2] + [3] * length, response_length=length,
                  loss_mask=[1] * length, rollout_log_probs=[0.0] * length, reward=reward, status=status)


def group() -> list[Sample]:
    done, cut = SampleStatus.COMPLETED, SampleStatus.TRUNCATED
    return [sample(0, 1.0, 50, done), sample(1, 1.0, 95, done), sample(2, 0.0, 10, done), sample(3, 0.0, 100, cut)]


def test_the_filter_drops_truncated_samples_from_the_loss_but_not_from_the_group():
    samples = group()
    penalties, metrics = apply_overlong(samples, AlgorithmConfig(overlong_filter=True), 100)
    assert penalties is None
    assert metrics == {"rollout/overlong_filtered": 1.0, "rollout/overlong_filtered_frac": 0.25,
                       "rollout/overlong_steps_kept": 0.0}
    batch = RolloutBatch.from_samples(samples)
    assert batch.step_tokens == [50 + 95 + 10]  # the losses divide by the tokens trained on
    algo = AlgorithmConfig()
    compute_advantages(batch, algo, n_samples_per_prompt=4)
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    expected = (rewards - rewards.mean()) / (rewards.std() + 1e-6)  # the truncated reward still in mean and std
    per_sample = torch.split(batch.advantages, [50, 95, 10, 100])
    for row, value in zip(per_sample[:3], expected[:3].tolist(), strict=True):
        assert torch.equal(row, torch.full_like(row, value, dtype=torch.float32))
    assert not per_sample[3].any()


def test_the_penalty_shapes_the_reward_the_advantages_read():
    samples = group()
    penalties, metrics = apply_overlong(samples, AlgorithmConfig(overlong_buffer_len=20), 100)
    assert penalties.tolist() == [0.0, -0.75, 0.0, -1.0]
    assert metrics == {"rollout/overlong_penalty_mean": -0.4375, "rollout/overlong_penalized_frac": 0.5}
    assert [s.reward for s in samples] == [1.0, 1.0, 0.0, 0.0]  # the samples keep the reward's own value
    batch = RolloutBatch.from_samples(samples)
    batch.rewards = batch.rewards + penalties
    compute_advantages(batch, AlgorithmConfig(), n_samples_per_prompt=4)
    shaped = torch.tensor([1.0, 0.25, 0.0, -1.0], dtype=torch.float64)
    expected = ((shaped - shaped.mean()) / (shaped.std() + 1e-6)).to(torch.float32)
    firsts = batch.advantages[torch.tensor([0, 50, 145, 155])]
    assert torch.equal(firsts, expected)


def test_a_buffer_longer_than_the_response_is_refused(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"input": "1 + 1 =", "label": "2"}\n')
    base = [f"data.prompt_data={prompts}", "cluster.device=cpu", "rollout.max_response_len=4096"]
    with pytest.raises(ConfigError, match="^algorithm.overlong_buffer_len: 8192 is longer than rollout.max_resp"):
        load_config(None, [*base, "algorithm.overlong_buffer_len=8192"])
    assert load_config(None, [*base, "algorithm.overlong_buffer_len=1024"]).algorithm.overlong_buffer_len == 1024


def test_an_optimizer_step_of_only_truncated_samples_keeps_them():
    cut = [sample(i, 0.0, 100, SampleStatus.TRUNCATED) for i in range(2)]
    samples = group() + cut  # two optimizer steps: 4 samples, then 2 all truncated
    _, metrics = apply_overlong(samples, AlgorithmConfig(overlong_filter=True), 100, step_size=4)
    assert metrics["rollout/overlong_filtered"] == 1.0 and metrics["rollout/overlong_steps_kept"] == 1.0
    assert [sum(s.loss_mask) for s in samples] == [50, 95, 10, 0, 100, 100]
