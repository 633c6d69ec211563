"""DAPO's overlong handling (Yu et al. 2025, section 3.4), for long reasoning responses that hit the limit.

- Overlong filtering (``algorithm.overlong_filter``): a sample truncated at the length limit (status
  ``truncated``) is dropped from the loss: its ``loss_mask`` becomes 0, so it adds no tokens and no
  gradient, while its reward still counts in its group's statistics (GRPO's mean and std), as in DAPO.
- Soft overlong punishment (``algorithm.overlong_buffer_len``): a length penalty added to the reward,
  0 up to ``L_max - L_buffer`` tokens and falling linearly to ``-overlong_penalty_factor`` at ``L_max``
  (``rollout.max_response_len``)::

      penalty(L) = -factor * clamp((L - (L_max - L_buffer)) / L_buffer, 0, 1)

Both act where the rollout hands a step to the trainer (run/actors.py), on the samples' raw rewards
(``rollout/reward_mean`` stays the reward's); the step's metrics count them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from slime_rl.core.config import AlgorithmConfig
from slime_rl.core.sample import Sample, SampleStatus


def overlong_penalties(lengths: Tensor, max_len: int, buffer_len: int, factor: float) -> Tensor:
    """DAPO's soft overlong punishment of each response length, float64 (the formula above)."""
    if buffer_len < 1 or buffer_len > max_len:
        raise ValueError(f"algorithm.overlong_buffer_len: {buffer_len} must be in 1..rollout.max_response_len"
                         f" ({max_len})")
    exceed = lengths.to(torch.float64) - (max_len - buffer_len)
    return -factor * (exceed / buffer_len).clamp(0.0, 1.0)


def apply_overlong(samples: Sequence[Sample], algo: AlgorithmConfig, max_len: int,
                   step_size: int | None = None) -> tuple[Tensor | None, dict]:
    """Drop truncated samples from the loss (in place, ``overlong_filter``) and return each sample's reward
    penalty (``overlong_buffer_len``; None when off) with the step's metrics. ``samples`` come in optimizer
    steps of ``step_size`` (default: one step): a step whose every sample was truncated keeps them (the
    losses divide by the step's trained tokens, which must not be 0), counted in
    ``rollout/overlong_steps_kept``."""
    metrics: dict[str, float] = {}
    if algo.overlong_filter:
        step_size = step_size or max(1, len(samples))
        filtered = kept_steps = 0
        for start in range(0, len(samples), step_size):
            step = samples[start:start + step_size]
            truncated = [s for s in step if s.status == SampleStatus.TRUNCATED]
            if len(truncated) == len(step):
                kept_steps += 1
                continue
            for s in truncated:
                s.loss_mask = [0] * s.response_length
            filtered += len(truncated)
        metrics["rollout/overlong_filtered"] = float(filtered)
        metrics["rollout/overlong_filtered_frac"] = filtered / len(samples) if samples else 0.0
        metrics["rollout/overlong_steps_kept"] = float(kept_steps)
    if algo.overlong_buffer_len is None:
        return None, metrics
    lengths = torch.tensor([s.response_length for s in samples], dtype=torch.float64)
    penalties = overlong_penalties(lengths, max_len, algo.overlong_buffer_len, algo.overlong_penalty_factor)
    metrics["rollout/overlong_penalty_mean"] = float(penalties.mean()) if len(samples) else 0.0
    metrics["rollout/overlong_penalized_frac"] = float((penalties < 0).double().mean()) if len(samples) else 0.0
    return penalties, metrics
