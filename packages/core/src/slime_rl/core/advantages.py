"""Advantage estimators.

Small pure functions over padded ``[batch, response_len]`` tensors (or
``[num_groups, n_samples_per_prompt]`` sequence rewards), and
:func:`compute_advantages`, which applies the configured one to a list of
samples. docs/algorithms.md has every formula.

Conventions: ``valid`` is 1 on real response tokens and 0 on padding;
``loss_mask`` is 1 on the tokens trained on (0 on padding and on tool or
observation output). A KL term ``kl`` is the per-token ``old_log_probs -
ref_log_probs`` (k1), counted only where ``loss_mask`` is 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from slime_rl.core.config import AlgorithmConfig
from slime_rl.core.sample import Sample

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


def whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` with mean and (unbiased) variance over the masked entries."""
    count = mask.sum()
    if count < 1:
        return x
    mean = (x * mask).sum() / count
    var = (((x - mean) * mask) ** 2).sum() / (count - 1).clamp(min=1)
    return (x - mean) * torch.rsqrt(var + eps)


# ---------------------------------------------------------------- samples -> advantages


def compute_advantages(
    samples: list[Sample], algo: AlgorithmConfig, *, n_samples_per_prompt: int, reward_key: str | None = None
) -> None:
    """Fill ``sample.advantages`` (and ``sample.returns`` for ppo) for every sample.

    Groups are consecutive runs of ``n_samples_per_prompt`` samples sharing
    ``group_index``. Advantages are 0 on tokens with ``loss_mask`` 0 (an empty
    ``loss_mask`` trains every token).
    ``algo.kl_coef`` charges ``old_log_probs - ref_log_probs`` as a reward
    penalty (no penalty when the samples carry no ``ref_log_probs``)."""
    if not samples:
        return
    _check_groups(samples, n_samples_per_prompt)
    for s in samples:
        if s.loss_mask:  # empty: every response token is trained on
            _check_per_token(s, "loss_mask")
    rewards = torch.tensor([s.reward_value(reward_key) for s in samples], dtype=torch.float64)
    lengths = [s.response_length for s in samples]
    loss_mask = _pad([s.loss_mask or [1] * s.response_length for s in samples], lengths)
    valid = _pad([[1.0] * n for n in lengths], lengths)
    kl = _token_kl(samples, lengths) * loss_mask
    n = n_samples_per_prompt
    estimator = algo.advantage_estimator
    whiten_batch = algo.normalize_advantages
    returns = None

    if estimator in ("grpo", "gspo", "dr_grpo", "rloo"):
        grouped = (rewards - algo.kl_coef * kl.sum(-1)).view(-1, n)
        if estimator == "dr_grpo":
            seq_adv = dr_grpo_advantages(grouped)
        elif estimator == "rloo":
            seq_adv = rloo_advantages(grouped)
        else:
            seq_adv = grpo_advantages(grouped, normalize_std=algo.grpo_std_normalization)
        advantages = seq_adv.reshape(-1, 1) * valid
    elif estimator == "reinforce_plus_plus":
        token_rewards = outcome_token_rewards(rewards, loss_mask, valid) - algo.kl_coef * kl
        advantages = discounted_returns(token_rewards, valid, algo.gamma)
        whiten_batch = True
    elif estimator == "reinforce_plus_plus_baseline":
        centered = dr_grpo_advantages(rewards.view(-1, n)).reshape(-1, 1)
        advantages = centered * valid - algo.kl_coef * kl
        whiten_batch = True
    elif estimator == "ppo":
        for s in samples:
            _check_per_token(s, "values", hint="ppo needs critic values (PolicyTrainer.compute_values)")
        values = _pad([s.values for s in samples], lengths)
        token_rewards = outcome_token_rewards(rewards, loss_mask, valid) - algo.kl_coef * kl
        advantages, returns = gae(token_rewards, values, valid, algo.gamma, algo.lambd)
    else:
        raise ValueError(f"algorithm.advantage_estimator: unknown estimator {estimator!r}")

    if whiten_batch:
        advantages = whiten(advantages, loss_mask)
    advantages = advantages * loss_mask
    for i, s in enumerate(samples):
        s.advantages = advantages[i, : lengths[i]].tolist()
        if returns is not None:
            s.returns = returns[i, : lengths[i]].tolist()


def _check_groups(samples: list[Sample], n: int) -> None:
    if n < 1 or len(samples) % n:
        raise ValueError(f"{len(samples)} samples do not split into groups of n_samples_per_prompt={n}")
    for start in range(0, len(samples), n):
        group = samples[start : start + n]
        if any(s.group_index != group[0].group_index for s in group):
            raise ValueError(
                f"samples {start}..{start + n - 1} should form one group but carry group_index "
                f"{sorted({s.group_index for s in group})}; keep each prompt's samples together, in runs of {n}"
            )


def _check_per_token(sample: Sample, name: str, hint: str = "") -> None:
    got = len(getattr(sample, name))
    if got != sample.response_length:
        extra = f"; {hint}" if hint else ""
        raise ValueError(f"sample {sample.index}: {name} has {got} entries for {sample.response_length} "
                         f"response tokens{extra}")


def _token_kl(samples: list[Sample], lengths: list[int]) -> Tensor:
    """``old_log_probs - ref_log_probs`` per token (the engine's log-probs when the trainer's are absent)."""
    with_ref = [bool(s.ref_log_probs) for s in samples]
    if not any(with_ref):
        return _pad([[] for _ in samples], lengths)
    if not all(with_ref):
        raise ValueError("some samples carry ref_log_probs and some do not; compute them for the whole batch")
    old = []
    for s in samples:
        _check_per_token(s, "ref_log_probs")
        name = "old_log_probs" if s.old_log_probs else "rollout_log_probs"
        _check_per_token(s, name, hint="the KL penalty needs the policy's log-probs")
        old.append(getattr(s, name))
    return _pad(old, lengths) - _pad([s.ref_log_probs for s in samples], lengths)


def _pad(rows: Sequence[Sequence[float]], lengths: Sequence[int]) -> Tensor:
    out = torch.zeros(len(rows), max(lengths, default=0), dtype=torch.float64)
    for i, row in enumerate(rows):
        if len(row):
            out[i, : len(row)] = torch.as_tensor(row, dtype=torch.float64)
    return out
