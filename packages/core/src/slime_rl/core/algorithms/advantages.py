"""Advantage estimators.

Small pure functions over padded ``[batch, response_len]`` tensors (or
``[num_groups, n_samples_per_prompt]`` sequence rewards), and
:func:`compute_advantages`, which applies the configured one to a trainer rank's
`RolloutBatch` shard. docs/algorithms.md has every formula.

Conventions: ``valid`` is 1 on real response tokens and 0 on padding;
``loss_mask`` is 1 on the tokens trained on (0 on padding and on tool or
observation output). A KL term ``kl`` is the per-token ``old_log_probs -
ref_log_probs`` (k1), counted only where ``loss_mask`` is 1.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from slime_rl.core.batch import RolloutBatch
from slime_rl.core.config import AlgorithmConfig

#: Sums a tensor over the data-parallel ranks (the trainer's all-reduce); one rank: itself.
SumOverDP = Callable[[Tensor], Tensor]


def _local(tensor: Tensor) -> Tensor:
    return tensor


# ---------------------------------------------------------------- sequence-level estimators


def grpo_advantages(rewards: Tensor, normalize_std: bool, eps: float = 1e-6) -> Tensor:
    """``[num_groups, n]`` rewards -> ``(r - group mean) / (group std + eps)``.

    The std is the unbiased one (as slime and verl use); with ``normalize_std``
    off, or one sample per group, only the mean is subtracted."""
    centered = rewards - rewards.mean(dim=-1, keepdim=True)
    if not normalize_std or rewards.shape[-1] == 1:
        return centered
    return centered / (rewards.std(dim=-1, keepdim=True) + eps)


def dr_grpo_advantages(rewards: Tensor) -> Tensor:
    """Dr. GRPO: ``r - group mean``, no std division (the length bias lives in the loss; see loss_agg)."""
    return rewards - rewards.mean(dim=-1, keepdim=True)


def rloo_advantages(rewards: Tensor) -> Tensor:
    """RLOO: ``r_i - mean_{j != i} r_j``, which equals ``n / (n - 1) * (r_i - group mean)``."""
    n = rewards.shape[-1]
    if n < 2:
        raise ValueError("algorithm.advantage_estimator=rloo needs data.n_samples_per_prompt >= 2 "
                         "(the baseline leaves the sample itself out)")
    return (rewards - rewards.mean(dim=-1, keepdim=True)) * (n / (n - 1))


# ---------------------------------------------------------------- token-level estimators


def outcome_token_rewards(seq_rewards: Tensor, loss_mask: Tensor, valid: Tensor) -> Tensor:
    """Place each sequence reward on its last trained token (its last token if none is trained)."""
    out = torch.zeros_like(loss_mask, dtype=seq_rewards.dtype)
    if loss_mask.shape[-1] == 0:
        return out
    positions = torch.arange(loss_mask.shape[-1], device=loss_mask.device)
    anchor = torch.where(loss_mask.sum(-1) > 0, _last_index(loss_mask, positions), _last_index(valid, positions))
    out[torch.arange(len(seq_rewards)), anchor] = seq_rewards
    return out


def _last_index(mask: Tensor, positions: Tensor) -> Tensor:
    return torch.where(mask > 0, positions, -1).amax(dim=-1).clamp(min=0)


def discounted_returns(token_rewards: Tensor, valid: Tensor, gamma: float) -> Tensor:
    """``G_t = r_t + gamma * G_{t+1}`` per row, 0 on padding."""
    token_rewards = token_rewards * valid
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[-1])):
        running = token_rewards[:, t] + gamma * running
        returns[:, t] = running
    return returns * valid


def gae(rewards: Tensor, values: Tensor, valid: Tensor, gamma: float, lambd: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over padded rows -> ``(advantages, returns)``.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` (``V`` is 0 past the last token),
    ``A_t = delta_t + gamma * lambd * A_{t+1}``, ``returns = A + V``."""
    rewards, values = rewards * valid, values * valid
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    next_value = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[-1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = delta + gamma * lambd * running
        advantages[:, t] = running
        next_value = values[:, t]
    advantages = advantages * valid
    return advantages, (advantages + values) * valid


def whiten(x: Tensor, mask: Tensor, eps: float = 1e-8, *, sum_over_dp: SumOverDP | None = None) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` with mean and (unbiased) variance over the masked entries
    (of every data-parallel rank, their sums added by ``sum_over_dp``)."""
    total = sum_over_dp or _local
    count, x_sum = total(torch.stack([mask.sum(), (x * mask).sum()]).to(torch.float64))
    if count < 1:
        return x
    mean = x_sum / count
    var = total((((x - mean) * mask) ** 2).sum().to(torch.float64).reshape(1))[0] / (count - 1).clamp(min=1)
    return (x - mean) * torch.rsqrt(var + eps)


# ---------------------------------------------------------------- a batch's advantages


def compute_advantages(batch: RolloutBatch, algo: AlgorithmConfig, *, n_samples_per_prompt: int,
                       sum_over_dp: SumOverDP = _local) -> None:
    """Fill ``batch.advantages`` (and ``batch.returns`` for ppo) on one data-parallel rank's shard.

    Groups are runs of ``n_samples_per_prompt`` consecutive step positions sharing a group id; a
    group may span ranks: per-sample values are summed over the ranks (``sum_over_dp``, the
    trainer's all-reduce over its data-parallel group) into the whole step before group
    statistics, and batch whitening sums its moments the same way. Advantages are 0 where
    ``loss_mask`` is 0. ``algo.kl_coef`` charges ``old_log_probs - ref_log_probs`` as a reward
    penalty (none when the batch has no ``ref_log_probs``). Computed in float64, stored float32."""
    if len(batch) == 0:
        return
    n = n_samples_per_prompt
    for name in ("old_log_probs", "ref_log_probs", "values"):
        column = getattr(batch, name)
        if column is not None and len(column) != batch.num_response_tokens:
            raise ValueError(f"{name} has {len(column)} entries for the batch's {batch.num_response_tokens} "
                             "response tokens; the trainer must return one per response token")
    loss_mask = batch.padded(batch.loss_mask, dtype=torch.float64)
    valid = batch.response_mask().to(torch.float64)
    kl = _token_kl(batch) * loss_mask
    rewards = batch.rewards.to(torch.float64)
    estimator = algo.advantage_estimator
    whiten_batch = algo.normalize_advantages
    returns = None

    def whole_step(per_sample: Tensor) -> Tensor:
        """This shard's per-sample values -> ``[num_groups, n]`` over the whole step."""
        full = torch.zeros(batch.step_size, dtype=torch.float64)
        full[batch.positions] = per_sample.to(torch.float64)
        return sum_over_dp(full).view(-1, n)

    def mine(grouped: Tensor) -> Tensor:
        return grouped.reshape(-1)[batch.positions]

    if estimator in ("grpo", "gspo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline"):
        if n < 1 or batch.step_size % n:
            raise ValueError(f"{batch.step_size} samples do not split into groups of n_samples_per_prompt={n}")
        _check_groups(whole_step(batch.group_ids.to(torch.float64) + 1), whole_step(torch.ones(len(batch))), n)
    if estimator in ("grpo", "gspo", "dr_grpo", "rloo"):
        grouped = whole_step(rewards - algo.kl_coef * kl.sum(-1))
        if estimator == "dr_grpo":
            seq_adv = dr_grpo_advantages(grouped)
        elif estimator == "rloo":
            seq_adv = rloo_advantages(grouped)
        else:
            seq_adv = grpo_advantages(grouped, normalize_std=algo.grpo_std_normalization)
        advantages = mine(seq_adv)[:, None] * valid
    elif estimator == "reinforce_plus_plus":
        token_rewards = outcome_token_rewards(rewards, loss_mask, valid) - algo.kl_coef * kl
        advantages = discounted_returns(token_rewards, valid, algo.gamma)
        whiten_batch = True
    elif estimator == "reinforce_plus_plus_baseline":
        centered = mine(dr_grpo_advantages(whole_step(rewards)))[:, None]
        advantages = centered * valid - algo.kl_coef * kl
        whiten_batch = True
    elif estimator == "ppo":
        if batch.values is None:
            raise ValueError("ppo needs critic values (PolicyTrainer.compute_values) on the batch")
        values = batch.padded(batch.values, dtype=torch.float64)
        token_rewards = outcome_token_rewards(rewards, loss_mask, valid) - algo.kl_coef * kl
        advantages, returns = gae(token_rewards, values, valid, algo.gamma, algo.lambd)
    else:
        raise ValueError(f"algorithm.advantage_estimator: unknown estimator {estimator!r}")

    if whiten_batch:
        advantages = whiten(advantages, loss_mask, sum_over_dp=sum_over_dp)
    batch.advantages = batch.unpad(advantages * loss_mask).to(torch.float32)
    if returns is not None:
        batch.returns = batch.unpad(returns).to(torch.float32)


def _check_groups(group_ids: Tensor, present: Tensor, n: int) -> None:
    """Every step position filled by exactly one rank, and each run of ``n`` one group."""
    if not torch.equal(present, torch.ones_like(present)):
        raise ValueError("the data-parallel shards do not cover the step exactly once (positions missing or repeated)")
    for row, ids in enumerate(group_ids.tolist()):
        if len(set(ids)) != 1:
            raise ValueError(
                f"samples {row * n}..{row * n + n - 1} should form one group but carry group_index "
                f"{sorted({int(i) - 1 for i in ids})}; keep each prompt's samples together, in runs of {n}")


def _token_kl(batch: RolloutBatch) -> Tensor:
    """``old - ref`` log-probs per token, ``[B, longest]`` (the engine's log-probs when the trainer's are absent)."""
    if batch.ref_log_probs is None:
        return batch.response_mask().to(torch.float64) * 0
    old = batch.old_log_probs if batch.old_log_probs is not None else batch.rollout_log_probs
    return batch.padded(old.to(torch.float64) - batch.ref_log_probs.to(torch.float64), dtype=torch.float64)
