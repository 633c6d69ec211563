"""Advantage estimators.

Small pure functions over padded ``[batch, response_len]`` tensors (or
``[num_groups, n_samples_per_prompt]`` sequence rewards); the estimators built on them, each
``fn(inputs: AdvantageInputs)`` and named with what it declares in registry.py; and
:func:`compute_advantages`, which applies the configured one to a trainer rank's
`RolloutBatch` shard. docs/algorithms.md has every formula.

Conventions: ``valid`` is 1 on real response tokens and 0 on padding;
``loss_mask`` is 1 on the tokens trained on (0 on padding and on tool or
observation output). A KL term ``kl`` is the per-token ``old_log_probs -
ref_log_probs`` (k1), counted only where ``loss_mask`` is 1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from slime_rl.core.algorithms.registry import advantage_estimator_of
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
    off, or one sample per group, only the mean is subtracted. Each group is divided by its
    largest ``|r|`` first and the result scaled back: the same value, but a sum or a square
    cannot overflow for any finite reward (rewards of 1e160 and 0 would otherwise give a
    variance of inf and advantages of 0)."""
    scale = rewards.abs().amax(dim=-1, keepdim=True).clamp(min=torch.finfo(rewards.dtype).tiny)
    unit = rewards / scale
    centered = unit - unit.mean(dim=-1, keepdim=True)
    if not normalize_std or rewards.shape[-1] == 1:
        return centered * scale
    return centered / (unit.std(dim=-1, keepdim=True) + eps / scale)


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


# ---------------------------------------------------------------- the estimators (registry.py names them)


@dataclass
class AdvantageInputs:
    """What an estimator gets: one data-parallel rank's shard, padded to ``[B, T]``, in float64.

    A group may span ranks: :meth:`grouped` gathers per-sample values of the whole step into
    ``[num_groups, n]`` (an all-reduce, so every rank must call it alike) and :meth:`mine` takes
    this shard's rows back; only an estimator that declares ``groups`` may call them."""

    rewards: Tensor  # [B] sequence rewards
    kl: Tensor  # [B, T] old - ref log-probs on trained tokens (k1); 0 without a reference model
    loss_mask: Tensor  # [B, T] 1 on trained tokens
    valid: Tensor  # [B, T] 1 on response tokens, 0 on padding
    values: Tensor | None  # [B, T] the critic's values (an estimator that declares needs_critic)
    algo: AlgorithmConfig
    n_samples_per_prompt: int
    step_size: int  # samples in the whole step (all ranks)
    positions: Tensor  # [B] each sample's position in the step
    sum_over_dp: SumOverDP = _local
    # [B, T] on-policy distillation (an estimator that declares needs_teacher): the student's sampling
    # log-probs (old, else the engine's) and the teacher's of the same tokens; None otherwise
    log_probs: Tensor | None = None
    teacher_log_probs: Tensor | None = None
    groups_checked: bool = False  # the step holds each group as one run of n (the estimator declares groups)

    def grouped(self, per_sample: Tensor) -> Tensor:
        """This shard's ``[B]`` per-sample values -> ``[num_groups, n]`` over the whole step."""
        if not self.groups_checked:
            raise ValueError("AdvantageInputs.grouped: the estimator must declare groups=True to use groups")
        full = torch.zeros(self.step_size, dtype=torch.float64)
        full[self.positions] = per_sample.to(torch.float64)
        return self.sum_over_dp(full).view(-1, self.n_samples_per_prompt)

    def mine(self, grouped: Tensor) -> Tensor:
        """``[num_groups, n]`` over the whole step -> this shard's ``[B]``."""
        return grouped.reshape(-1)[self.positions]


#: What an estimator returns: ``[B, T]`` advantages, or ``(advantages, returns)``.
EstimatorResult = Tensor | tuple[Tensor, Tensor]


def _penalised_groups(inputs: AdvantageInputs) -> Tensor:
    """Sequence rewards less the summed KL penalty, ``[num_groups, n]`` over the whole step."""
    return inputs.grouped(inputs.rewards - inputs.algo.kl_coef * inputs.kl.sum(-1))


def _per_token(inputs: AdvantageInputs, seq_advantages: Tensor) -> Tensor:
    return inputs.mine(seq_advantages)[:, None] * inputs.valid


def grpo_estimator(inputs: AdvantageInputs) -> Tensor:
    return _per_token(inputs, grpo_advantages(_penalised_groups(inputs),
                                              normalize_std=inputs.algo.grpo_std_normalization))


def dr_grpo_estimator(inputs: AdvantageInputs) -> Tensor:
    return _per_token(inputs, dr_grpo_advantages(_penalised_groups(inputs)))


def rloo_estimator(inputs: AdvantageInputs) -> Tensor:
    return _per_token(inputs, rloo_advantages(_penalised_groups(inputs)))


def _token_rewards(inputs: AdvantageInputs) -> Tensor:
    """The sequence reward on the last trained token, less the per-token KL penalty."""
    outcome = outcome_token_rewards(inputs.rewards, inputs.loss_mask, inputs.valid)
    return outcome - inputs.algo.kl_coef * inputs.kl


def reinforce_plus_plus_estimator(inputs: AdvantageInputs) -> Tensor:
    return discounted_returns(_token_rewards(inputs), inputs.valid, inputs.algo.gamma)


def reinforce_plus_plus_baseline_estimator(inputs: AdvantageInputs) -> Tensor:
    centered = inputs.mine(dr_grpo_advantages(inputs.grouped(inputs.rewards)))[:, None]
    return centered * inputs.valid - inputs.algo.kl_coef * inputs.kl


def opd_advantages(teacher_log_probs: Tensor, student_log_probs: Tensor, valid: Tensor) -> Tensor:
    """On-policy distillation per token: ``log pi_T(y_t) - log pi_S(y_t)`` on the student's own sampled
    tokens, 0 on padding. Its negative is the one-sample estimate of the reverse KL ``KL(pi_S || pi_T)`` at
    that position; as an advantage in the policy gradient, ``E[A_t grad log pi_S] = -grad KL`` (the
    ``E[grad log pi_S] = 0`` term drops out), so the update descends the student's reverse KL to the teacher."""
    return (teacher_log_probs - student_log_probs) * valid


def opd_estimator(inputs: AdvantageInputs) -> Tensor:
    if inputs.teacher_log_probs is None or inputs.log_probs is None:
        raise ValueError("opd needs the teacher's log-probs on the batch (a roles entry of kind teacher)")
    algo = inputs.algo
    advantages = algo.opd_kl_coef * opd_advantages(inputs.teacher_log_probs, inputs.log_probs, inputs.valid)
    if algo.opd_reward_coef:
        advantages = advantages + algo.opd_reward_coef * grpo_estimator(inputs)
    return advantages


def gae_estimator(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    assert inputs.values is not None  # the estimator declares needs_critic: compute_advantages checked
    return gae(_token_rewards(inputs), inputs.values, inputs.valid, inputs.algo.gamma, inputs.algo.lambd)


# ---------------------------------------------------------------- a batch's advantages


def compute_advantages(batch: RolloutBatch, algo: AlgorithmConfig, *, n_samples_per_prompt: int,
                       sum_over_dp: SumOverDP = _local) -> None:
    """Fill ``batch.advantages`` (and ``batch.returns`` when the estimator gives them: ppo) on one
    data-parallel rank's shard, with the estimator ``algo.advantage_estimator`` names (registry.py).

    Groups are runs of ``n_samples_per_prompt`` consecutive step positions sharing a group id; a
    group may span ranks: per-sample values are summed over the ranks (``sum_over_dp``, the
    trainer's all-reduce over its data-parallel group) into the whole step before group
    statistics, and batch whitening sums its moments the same way. Advantages are 0 where
    ``loss_mask`` is 0. ``algo.kl_coef`` charges ``old_log_probs - ref_log_probs`` as a reward
    penalty (none when the batch has no ``ref_log_probs``). Computed in float64, stored float32."""
    if len(batch) == 0:
        return
    estimator = advantage_estimator_of(algo)
    n = n_samples_per_prompt
    for name in ("old_log_probs", "ref_log_probs", "values"):
        column = getattr(batch, name)
        if column is not None and len(column) != batch.num_response_tokens:
            raise ValueError(f"{name} has {len(column)} entries for the batch's {batch.num_response_tokens} "
                             "response tokens; the trainer must return one per response token")
    if estimator.needs_teacher and batch.teacher_log_probs is None:
        raise ValueError(f"{estimator.name} needs the teacher's log-probs (roles, kind teacher) on the batch")
    if estimator.needs_critic and batch.values is None:
        raise ValueError(f"{estimator.name} needs critic values (PolicyTrainer.compute_values) on the batch")
    loss_mask = batch.padded(batch.loss_mask, dtype=torch.float64)
    inputs = AdvantageInputs(
        rewards=batch.rewards.to(torch.float64), kl=_token_kl(batch) * loss_mask, loss_mask=loss_mask,
        valid=batch.response_mask().to(torch.float64),
        values=None if batch.values is None else batch.padded(batch.values, dtype=torch.float64), algo=algo,
        n_samples_per_prompt=n, step_size=batch.step_size, positions=batch.positions, sum_over_dp=sum_over_dp)
    if batch.teacher_log_probs is not None:
        student = batch.old_log_probs if batch.old_log_probs is not None else batch.rollout_log_probs
        inputs.log_probs = batch.padded(student, dtype=torch.float64)
        inputs.teacher_log_probs = batch.padded(batch.teacher_log_probs, dtype=torch.float64)
    if estimator.groups:
        if n < 1 or batch.step_size % n:
            raise ValueError(f"{batch.step_size} samples do not split into groups of n_samples_per_prompt={n}")
        inputs.groups_checked = True
        group_ids, present = batch.group_ids.to(torch.float64) + 1, torch.ones(len(batch))
        _check_groups(inputs.grouped(group_ids), inputs.grouped(present), n)
    result = estimator.load()(inputs)
    advantages, returns = result if isinstance(result, tuple) else (result, None)
    for what, tensor in (("advantages", advantages), ("returns", returns)):
        if tensor is not None and (not isinstance(tensor, Tensor) or tensor.shape != loss_mask.shape):
            got = f"of shape {tuple(tensor.shape)}" if isinstance(tensor, Tensor) else f"as a {type(tensor).__name__}"
            raise ValueError(f"algorithm.advantage_estimator {estimator.name!r} returned {what} {got};"
                             f" give one value per padded response token, {tuple(loss_mask.shape)}")

    if estimator.whitens or algo.normalize_advantages:
        advantages = whiten(advantages.to(torch.float64), loss_mask, sum_over_dp=sum_over_dp)
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
