"""Staleness per token: how many policy versions behind the trainer each response token is, and
what ``rollout.staleness_policy`` does about tokens more than ``rollout.max_staleness`` (eta) behind.

A token's staleness is ``current_version - token_version``, where ``current_version`` is the
version of the weights the trainer is about to update (the step's ``old`` policy) and
``token_version`` the version that sampled the token (`Sample.token_versions`; a response that
spans an in-flight weight update holds several). AReaL's eta means the same: a group is eligible
only while its oldest token is at most eta versions behind.

- ``drop``: a group whose oldest token is stale is not trained on (`eligible`); the caller records it.
- ``mask``: stale tokens get loss-mask 0; the response's fresh tokens still train.
- ``downweight``: stale tokens get loss weight ``(eta + 1) / (staleness + 1)`` (`RolloutBatch.token_weights`).

Without eta (``max_staleness: null``) nothing is stale; the metrics are still reported.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import torch

from slime_rl.core.sample import Sample

Group = list[Sample]


def oldest_version(group: Sequence[Sample]) -> int | None:
    """The version of the group's oldest response token (None: no response token yet)."""
    versions = [v for s in group for v in s.versions_per_token()]
    return min(versions) if versions else None


def eligible(group: Sequence[Sample], current_version: int, max_staleness: int | None) -> bool:
    """Whether a group may still be trained on at ``current_version``: its oldest token is at most eta behind."""
    oldest = oldest_version(group)
    return max_staleness is None or oldest is None or current_version - oldest <= max_staleness


def apply_policy(samples: Sequence[Sample], current_version: int, max_staleness: int | None,
                 policy: str) -> torch.Tensor | None:
    """Apply ``policy`` to the step's samples in place (``mask`` zeroes stale tokens' loss mask) and
    return the per-token weights (``[sum of response lengths]`` float32) for ``downweight``, else None.
    Under ``drop`` the caller has already left ineligible groups out; nothing changes here."""
    if max_staleness is None or policy == "drop":
        return None
    if policy == "mask":
        for s in samples:
            versions = s.versions_per_token()
            if any(current_version - v > max_staleness for v in versions):
                mask = s.loss_mask or [1] * s.response_length
                s.loss_mask = [0 if current_version - v > max_staleness else m
                               for m, v in zip(mask, versions, strict=True)]
        return None
    if policy != "downweight":
        raise ValueError(f"rollout.staleness_policy: {policy!r} is not one of drop, mask, downweight")
    weights = [(max_staleness + 1) / (current_version - v + 1) if current_version - v > max_staleness else 1.0
               for s in samples for v in s.versions_per_token()]
    if all(w == 1.0 for w in weights):
        return None
    return torch.tensor(weights, dtype=torch.float32)


def trainable_tokens(samples: Sequence[Sample]) -> int:
    return sum(sum(s.loss_mask) if s.loss_mask else s.response_length for s in samples)


def metrics(samples: Sequence[Sample], current_version: int) -> dict[str, float]:
    """The step's staleness distribution over response tokens, and how many responses span versions."""
    staleness = [current_version - v for s in samples for v in s.versions_per_token()]
    if not staleness:
        return {}
    out = {
        "staleness/max": float(max(staleness)),
        "staleness/mean": statistics.fmean(staleness),
        "staleness/mixed_version_frac": sum(len(set(s.versions_per_token())) > 1 for s in samples) / len(samples),
    }
    for k in (0, 1):
        out[f"staleness/frac_{k}"] = sum(x == k for x in staleness) / len(staleness)
    out["staleness/frac_2_plus"] = sum(x >= 2 for x in staleness) / len(staleness)
    return out
