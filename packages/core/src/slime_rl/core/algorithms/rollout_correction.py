"""Corrections of the mismatch between the trainer's and the engine's log-probs of the sampled tokens
(``algorithm.rollout_correction``, or ``use_tis``), and their metrics.

Per token ``q_t = exp(log pi_old(y_t) - log pi_roll(y_t))`` (the log clamped at +-LOG_RATIO_LIMIT); per
sequence ``g_i = exp(sum_t m_t log q_t / sum_t m_t)``, the geometric mean of its trained tokens' ratios.
A correction is ``fn(inputs: CorrectionInputs) -> CorrectionTerms`` (a registry entry: registry.py names
the built-ins below); compute_loss multiplies its weight into the policy surrogate. The step's
denominators (``num_tokens``, ``num_seqs``) are not changed: a masked token adds 0 to the loss and
still counts in them. docs/algorithms.md has the formulas.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

LOG_RATIO_LIMIT = 20.0  # |log pi/pi_old| beyond this is clamped so exp() stays finite
DIST_SUFFIX = "_dist"  # a metric of raw values (NaN: none): concatenated over parts, reported as its quantiles
QUANTILES = (5, 50, 95)


@dataclass
class CorrectionInputs:
    """What a correction gets: padded ``[B, T]`` tensors over response tokens, none with gradient."""

    old_log_probs: Tensor
    rollout_log_probs: Tensor  # the engine's
    loss_mask: Tensor
    log_ratio: Tensor  # log q_t, clamped at +-LOG_RATIO_LIMIT (0 where loss_mask is 0)
    seq_log_ratio: Tensor  # log g_i, broadcast to the tokens of sequence i
    low: float  # the band [low, high] of a masking correction
    high: float  # the cap of a truncating one, the top of the band of a masking one


@dataclass
class CorrectionTerms:
    """A correction's per-token ``[B, T]`` terms."""

    weight: Tensor  # multiplies each token's surrogate (no gradient); 0 where the token is masked
    masked: Tensor  # 1 where the correction dropped the token: the rollout_corr_masked_* metrics
    truncated: Tensor  # 1 where the weight was capped at high: rollout_corr_truncated_frac


def tis_weights(old_log_probs: Tensor, rollout_log_probs: Tensor, tis_clip: float) -> tuple[Tensor, Tensor]:
    """Truncated importance sampling for the trainer/engine mismatch -> ``(weight, truncated)``.

    weight = clamp(exp(old_logp - rollout_logp), 0, tis_clip), with no gradient."""
    raw = (old_log_probs - rollout_log_probs).clamp(max=LOG_RATIO_LIMIT).exp().detach()
    return raw.clamp(0.0, tis_clip), (raw > tis_clip).to(raw.dtype)


# ---------------------------------------------------------------- the built-ins (registry.py declares them)


def tis(inputs: CorrectionInputs) -> CorrectionTerms:
    """w_t = min(q_t, high)."""
    weight, truncated = tis_weights(inputs.old_log_probs, inputs.rollout_log_probs, inputs.high)
    return CorrectionTerms(weight, torch.zeros_like(weight), truncated)


def icepop(inputs: CorrectionInputs) -> CorrectionTerms:
    """w_t = q_t * 1[low <= q_t <= high]."""
    return _masked(inputs.log_ratio.exp(), inputs.log_ratio, inputs)


def seq_tis(inputs: CorrectionInputs) -> CorrectionTerms:
    """w_t = min(g_i, high)."""
    rho = inputs.seq_log_ratio.exp()
    return CorrectionTerms(rho.clamp(max=inputs.high), torch.zeros_like(rho), (rho > inputs.high).to(rho.dtype))


def seq_mask_tis(inputs: CorrectionInputs) -> CorrectionTerms:
    """w_t = q_t * 1[low <= g_i <= high]."""
    return _masked(inputs.log_ratio.exp(), inputs.seq_log_ratio, inputs)


def _masked(weight: Tensor, tested_log_ratio: Tensor, inputs: CorrectionInputs) -> CorrectionTerms:
    tested = tested_log_ratio.exp()
    keep = (tested >= inputs.low) & (tested <= inputs.high)
    return CorrectionTerms(torch.where(keep, weight, torch.zeros_like(weight)), (~keep).to(weight.dtype),
                           torch.zeros_like(weight))


# ---------------------------------------------------------------- applied by compute_loss


def correction_band(algo: Any) -> tuple[float, float]:
    """``(low, high)`` of the correction in use: ``use_tis`` caps at ``tis_clip``; ``rollout_correction_low``
    defaults to ``1 / rollout_correction_high``."""
    if algo.rollout_correction is None:  # use_tis
        return 0.0, algo.tis_clip
    high = algo.rollout_correction_high
    low = algo.rollout_correction_low
    return (1.0 / high if low is None else low), high


def apply_correction(function: Callable[..., Any], name: str, algo: Any, old_log_probs: Tensor,
                     rollout_log_probs: Tensor, loss_mask: Tensor, *, agg: Callable[[Tensor], Tensor],
                     num_tokens: float, num_seqs: float) -> tuple[Tensor, dict[str, Tensor]]:
    """The correction's per-token weight (detached) and its metrics, over one micro-batch.

    The ``*_frac`` metrics are shares of the step's ``num_tokens`` loss tokens and ``num_seqs`` samples
    (so they sum over micro-batches and ranks whatever ``loss_agg``); the ``*_dist`` ones are the ratios
    themselves, which reduce_metrics turns into quantiles once it holds the whole step's."""
    old, rollout = old_log_probs.detach(), rollout_log_probs.detach()
    trained = (loss_mask > 0).to(old.dtype)
    log_ratio = torch.where(loss_mask > 0, old - rollout, torch.zeros_like(old)).clamp(-LOG_RATIO_LIMIT,
                                                                                       LOG_RATIO_LIMIT)
    tokens_per_seq = trained.sum(-1)
    seq_log_ratio = (log_ratio * loss_mask).sum(-1, keepdim=True) / loss_mask.sum(-1, keepdim=True).clamp(min=1e-12)
    seq_log_ratio = torch.where(tokens_per_seq[:, None] > 0, seq_log_ratio, torch.zeros_like(seq_log_ratio))
    low, high = correction_band(algo)
    terms = function(CorrectionInputs(old_log_probs=old, rollout_log_probs=rollout, loss_mask=loss_mask,
                                      log_ratio=log_ratio, seq_log_ratio=seq_log_ratio.expand_as(old),
                                      low=low, high=high))
    if not isinstance(terms, CorrectionTerms):
        raise ValueError(f"algorithm.rollout_correction {name!r} returned a {type(terms).__name__}; return"
                         " CorrectionTerms(weight, masked, truncated) of [B, T] tensors")
    for part in ("weight", "masked", "truncated"):
        if getattr(terms, part).shape != old.shape:
            raise ValueError(f"algorithm.rollout_correction {name!r} returned {part} of shape"
                             f" {tuple(getattr(terms, part).shape)}; give one value per padded token, {tuple(old.shape)}")
    weight = torch.where(loss_mask > 0, terms.weight.detach().to(old.dtype), torch.zeros_like(old))  # padding: 0
    masked = terms.masked.detach().to(old.dtype) * trained
    with torch.no_grad():
        seq_masked = (tokens_per_seq > 0) & (masked.sum(-1) == tokens_per_seq)
        metrics = {
            "rollout_corr_weight_mean": agg(weight),
            "rollout_corr_masked_frac": masked.sum() / num_tokens,
            "rollout_corr_masked_seq_frac": seq_masked.to(old.dtype).sum() / num_seqs,
            "rollout_corr_truncated_frac": (terms.truncated.detach().to(old.dtype) * trained).sum() / num_tokens,
            # NaN where there is no value: selecting on the GPU would wait for it in every micro-batch
            "rollout_corr_ratio" + DIST_SUFFIX: torch.where(loss_mask > 0, log_ratio.exp(), float("nan")),
            "rollout_corr_seq_ratio" + DIST_SUFFIX: torch.where(tokens_per_seq > 0, seq_log_ratio[:, 0].exp(),
                                                                float("nan")),
        }
        if algo.rollout_correction is None:  # use_tis: its metrics as before
            metrics["tis_weight_mean"] = agg(weight)
            metrics["tis_clipfrac"] = agg(terms.truncated.detach().to(old.dtype))
    return weight, metrics


def quantiles(values: Tensor, percents: tuple[int, ...] = QUANTILES) -> list[float]:
    """The ``percents`` percentiles of 1-D ``values``, interpolated linearly between order statistics
    (numpy's default), in float64."""
    ordered = values.detach().reshape(-1).to(torch.float64).sort().values
    n = ordered.numel()
    out = []
    for p in percents:
        position = p / 100 * (n - 1)
        below = int(position)
        above = min(below + 1, n - 1)
        out.append(float(ordered[below] + (ordered[above] - ordered[below]) * (position - below)))
    return out
