"""Micro-batches by token budget: every sample once, within the budget, no more micro-batches than
first-fit-decreasing packs, and even work across them on RL's long-tailed lengths."""

from __future__ import annotations

import random

import pytest

from slime_rl.trainer_megatron.batching import _first_fit_decreasing, group_rows, imbalance, sample_costs


def long_tail(n: int, seed: int) -> list[int]:
    """Prompt + response lengths as RL makes them: most responses short, a few near the limit."""
    rng = random.Random(seed)
    return [rng.randint(100, 500) + min(8192, int(rng.lognormvariate(5.5, 1.2))) for _ in range(n)]


@pytest.mark.parametrize("seed", range(5))
def test_token_budget_micro_batches_hold_every_sample_once_within_the_budget(seed):
    lengths = long_tail(128, seed) + [20000]  # one sample over the budget: a micro-batch of its own
    groups = group_rows(lengths, micro_batch_size=1, max_tokens=16384)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in g) <= 16384 or len(g) == 1 for g in groups)
    by_length = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    assert len(groups) <= len(_first_fit_decreasing(lengths, by_length, 16384))


def test_balanced_micro_batches_even_out_the_work_first_fit_leaves_in_the_last_one():
    worse, total = 0, 0
    for seed in range(20):
        lengths = long_tail(128, seed)
        costs = sample_costs(lengths)
        by_length = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        packed = _first_fit_decreasing(lengths, by_length, 16384)
        balanced = group_rows(lengths, micro_batch_size=1, max_tokens=16384)
        total += 1
        worse += imbalance(balanced, costs) > imbalance(packed, costs) + 1e-9
        if len(balanced) == len(packed) > 1:
            assert imbalance(balanced, costs) < 1.25
    assert worse == 0 and total == 20


def test_attention_weight_gives_a_long_sample_fewer_neighbours():
    lengths = [8000] + [500] * 30
    tokens_only = group_rows(lengths, micro_batch_size=1, max_tokens=12000)
    weighted = group_rows(lengths, micro_batch_size=1, max_tokens=12000, attention_weight=1e-3)
    with_long = [next(g for g in groups if 0 in g) for groups in (tokens_only, weighted)]
    assert len(with_long[1]) < len(with_long[0])
    costs = sample_costs(lengths, 1e-3)
    assert imbalance(weighted, costs) < imbalance(tokens_only, costs)


def test_count_micro_batches_stay_sorted_by_length():
    lengths = [5, 50, 7, 40, 3, 60]
    assert group_rows(lengths, micro_batch_size=2, max_tokens=None) == [[5, 1], [3, 2], [0, 4]]
