"""Dynamic-sampling filters, ``(group: list[Sample]) -> bool``: keep a scored group or not.

The rollout orchestrator over-samples until ``rollout_batch_size`` groups pass.
Users give their own as ``module:attr``.
"""

from __future__ import annotations

from slime_rl.core.sample import Sample


def nonzero_std(group: list[Sample]) -> bool:
    """DAPO dynamic sampling: keep a group only when its rewards are not all equal.

    A group whose samples all got the same reward has zero advantage under
    GRPO and teaches nothing. Dict rewards count as equal only when every
    entry is. A group of one sample has zero variance and is dropped.
    """
    rewards = []
    for sample in group:
        if sample.reward is None:
            raise ValueError(f"sample {sample.index} (group {sample.group_index}) has no reward; "
                             "the dynamic-sampling filter runs after rewards")
        rewards.append(sorted(sample.reward.items()) if isinstance(sample.reward, dict) else float(sample.reward))
    return any(r != rewards[0] for r in rewards[1:])


DYNAMIC_SAMPLING_FILTERS = {"nonzero_std": nonzero_std}
