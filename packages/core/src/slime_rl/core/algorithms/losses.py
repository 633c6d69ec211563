"""Policy, KL, entropy, value and SFT losses over padded ``[batch, response_len]`` tensors.

The policy surrogates are ``fn(inputs: PolicyLossInputs) -> PolicyLossTerms``, named with what
they declare in registry.py (``algorithm.policy_loss``, or a user's ``module:attr``).

Every tensor in a :class:`LossBatch` covers response tokens only; ``loss_mask``
is 0 on padding and on tokens not trained on. A trainer that packs sequences
turns its flat per-token tensors into rows with :func:`pad_sequences`.

Parallel training: :func:`compute_loss` divides by ``num_tokens`` and
``num_seqs``, the GLOBAL counts of one optimizer step (all micro-batches on all
data-parallel ranks). Summing the losses (and gradients) of the pieces
therefore gives the loss of the whole batch, and so do the metrics, except the
``*_max`` / ``*_min`` ones and the ``*_dist`` values (concatenated, then reported as
quantiles); :func:`reduce_metrics` combines them.
docs/algorithms.md has every formula.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from slime_rl.core.algorithms.registry import policy_loss_of, rollout_correction_of
from slime_rl.core.algorithms.rollout_correction import (
    DIST_SUFFIX,
    LOG_RATIO_LIMIT,
    QUANTILES,
    apply_correction,
    quantiles,
)
from slime_rl.core.algorithms.rollout_correction import (
    tis_weights as tis_weights,  # losses.tis_weights, as before
)
from slime_rl.core.config import AlgorithmConfig


@dataclass
class LossBatch:
    """Padded ``[B, T]`` float tensors over response tokens, one row per sample."""

    log_probs: Tensor  # current policy, requires grad
    old_log_probs: Tensor  # policy before the update (the rollout's when use_rollout_logprobs)
    advantages: Tensor
    loss_mask: Tensor  # 1 = trained on; 0 = padding, tool output, masked
    rollout_log_probs: Tensor | None = None  # the engine's (rollout corrections, mismatch metrics)
    ref_log_probs: Tensor | None = None  # reference model (KL loss)
    entropy: Tensor | None = None  # per-token entropy of the current policy (entropy bonus)


def pad_sequences(rows: Sequence[Tensor | Sequence[float]], *, value: float = 0.0,
                  dtype: torch.dtype | None = None) -> Tensor:
    """Right-pad variable-length rows into ``[B, max_len]``; keeps autograd for tensor rows.

    Packed layout: ``pad_sequences(flat.split(response_lengths))``."""
    tensors = [r if isinstance(r, Tensor) else torch.as_tensor(r, dtype=dtype or torch.float32) for r in rows]
    if not tensors:
        return torch.zeros(0, 0, dtype=dtype or torch.float32)
    out = torch.nn.utils.rnn.pad_sequence(tensors, batch_first=True, padding_value=value)
    return out if dtype is None else out.to(dtype)


# ---------------------------------------------------------------- aggregation


def aggregate(per_token: Tensor, loss_mask: Tensor, mode: str, *, num_tokens: float, num_seqs: float) -> Tensor:
    """Reduce ``[B, T]`` per-token values to a scalar.

    token-mean:          sum_i sum_t m*x / num_tokens
    seq-mean-token-sum:  sum_i sum_t m*x / num_seqs
    seq-mean-token-mean: sum_i (sum_t m*x / sum_t m) / num_seqs
    """
    masked = torch.where(loss_mask > 0, per_token, torch.zeros_like(per_token)) * loss_mask
    if mode == "token-mean":
        return masked.sum() / num_tokens
    if mode == "seq-mean-token-sum":
        return masked.sum() / num_seqs
    if mode == "seq-mean-token-mean":
        return (masked.sum(-1) / loss_mask.sum(-1).clamp(min=1)).sum() / num_seqs
    raise ValueError(f"algorithm.loss_agg: unknown mode {mode!r}; use token-mean, seq-mean-token-sum "
                     "or seq-mean-token-mean")


# ---------------------------------------------------------------- building blocks


def kl_estimate(log_probs: Tensor, ref_log_probs: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1/k2/k3).

    k1 = log r', k2 = (log r')^2 / 2, k3 = r - 1 - log r with r = pi_ref / pi and
    r' = 1/r; low_var_kl is k3 clamped to [-10, 10]."""
    log_ratio = log_probs - ref_log_probs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind in ("k3", "low_var_kl"):
        kl = torch.expm1(-log_ratio) + log_ratio
        return kl.clamp(-10.0, 10.0) if kind == "low_var_kl" else kl
    raise ValueError(f"algorithm.kl_loss_type: unknown {kind!r}; use k1, k2, k3 or low_var_kl")


def ppo_clip_loss(log_ratio: Tensor, advantages: Tensor, eps_clip: float, eps_clip_high: float,
                  eps_clip_c: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """PPO's clipped surrogate per token -> ``(loss, clipped, dual_clipped)``.

    loss = max(-A r, -A clip(r, 1 - eps_clip, 1 + eps_clip_high)); with dual-clip
    (eps_clip_c > 1) the loss of a negative-advantage token is capped at -eps_clip_c * A."""
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped_loss = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    clipped = clipped_loss > unclipped
    loss = torch.where(clipped, clipped_loss, unclipped)
    dual = torch.zeros_like(clipped)
    if eps_clip_c is not None:
        if eps_clip_c <= 1.0:
            raise ValueError(f"algorithm.eps_clip_c: dual-clip needs a value > 1, got {eps_clip_c}")
        bound = -advantages * eps_clip_c
        dual = (advantages < 0) & (bound < loss)
        loss = torch.where(dual, bound, loss)
    return loss, clipped.to(loss.dtype), dual.to(loss.dtype)


def sequence_log_ratio(log_probs: Tensor, old_log_probs: Tensor, loss_mask: Tensor) -> Tensor:
    """GSPO: each row's mean token log-ratio (log of the geometric-mean ratio), broadcast to ``[B, T]``."""
    diff = torch.where(loss_mask > 0, log_probs - old_log_probs, torch.zeros_like(log_probs)) * loss_mask
    per_seq = diff.sum(-1, keepdim=True) / loss_mask.sum(-1, keepdim=True).clamp(min=1)
    return per_seq.expand_as(log_probs)


def cispo_loss(log_probs: Tensor, log_ratio: Tensor, advantages: Tensor, eps_clip: float,
               eps_clip_high: float) -> tuple[Tensor, Tensor]:
    """CISPO (MiniMax-M1): ``-sg(clip(r, 1 - eps_clip, 1 + eps_clip_high)) * A * log_prob`` -> ``(loss, clipped)``.

    The weight is under stop-gradient, so clipped tokens still pass gradient
    through ``log_probs``. Canonical CISPO has no lower bound: set eps_clip >= 1."""
    ratio = log_ratio.exp()
    weight = ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high).detach()
    return -weight * advantages * log_probs, (weight != ratio).to(log_probs.dtype)


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, loss_mask: Tensor, *, value_clip: float,
               loss_agg: str, num_tokens: float, num_seqs: float) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss: ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)``, aggregated."""
    clipped_values = old_values + (values - old_values).clamp(-value_clip, value_clip)
    plain = (values - returns) ** 2
    clipped = (clipped_values - returns) ** 2
    use_clipped = clipped > plain
    per_token = 0.5 * torch.where(use_clipped, clipped, plain)

    def agg(x: Tensor) -> Tensor:
        return aggregate(x, loss_mask, loss_agg, num_tokens=num_tokens, num_seqs=num_seqs)

    loss = agg(per_token)
    return loss, {"value_loss": loss.detach(), "value_clipfrac": agg(use_clipped.to(per_token.dtype)).detach()}


def sft_loss(log_probs: Tensor, loss_mask: Tensor, *, loss_agg: str, num_tokens: float,
             num_seqs: float) -> tuple[Tensor, dict[str, Tensor]]:
    """Masked negative log-likelihood."""
    loss = aggregate(-log_probs, loss_mask, loss_agg, num_tokens=num_tokens, num_seqs=num_seqs)
    return loss, {"sft_loss": loss.detach(), "loss": loss.detach()}


# ---------------------------------------------------------------- the loss a trainer calls


@dataclass
class PolicyLossInputs:
    """What a policy loss gets: padded ``[B, T]`` tensors over response tokens (float32 or wider)."""

    log_probs: Tensor  # current policy, requires grad
    old_log_probs: Tensor
    log_ratio: Tensor  # log_probs - old_log_probs, clamped to +-LOG_RATIO_LIMIT
    advantages: Tensor
    loss_mask: Tensor
    algo: AlgorithmConfig
    eps_clip_high: float  # algorithm.eps_clip_high, defaulted to eps_clip


@dataclass
class PolicyLossTerms:
    """A policy loss's per-token ``[B, T]`` terms; compute_loss aggregates each (``algorithm.loss_agg``)."""

    loss: Tensor  # the surrogate (a rollout correction weights it when on)
    clipped: Tensor  # 1 where clipped: the clip_frac metric
    ratio: Tensor  # the ratio the loss used: the ratio_* metrics
    token_metrics: dict[str, Tensor] = field(default_factory=dict)  # more metrics, aggregated like the loss


def ppo_policy_loss(inputs: PolicyLossInputs) -> PolicyLossTerms:
    return _clipped_surrogate(inputs, inputs.log_ratio)


def gspo_policy_loss(inputs: PolicyLossInputs) -> PolicyLossTerms:
    log_ratio = sequence_log_ratio(inputs.log_probs, inputs.old_log_probs, inputs.loss_mask)
    return _clipped_surrogate(inputs, log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))


def _clipped_surrogate(inputs: PolicyLossInputs, log_ratio: Tensor) -> PolicyLossTerms:
    algo = inputs.algo
    loss, clipped, dual = ppo_clip_loss(log_ratio, inputs.advantages, algo.eps_clip, inputs.eps_clip_high,
                                        algo.eps_clip_c)
    return PolicyLossTerms(loss, clipped, log_ratio.exp(),
                           {"dual_clip_frac": dual} if algo.eps_clip_c is not None else {})


def cispo_policy_loss(inputs: PolicyLossInputs) -> PolicyLossTerms:
    loss, clipped = cispo_loss(inputs.log_probs, inputs.log_ratio, inputs.advantages, inputs.algo.eps_clip,
                               inputs.eps_clip_high)
    return PolicyLossTerms(loss, clipped, inputs.log_ratio.exp())


def compute_loss(algo: AlgorithmConfig, batch: LossBatch, *, eps_clip_high: float, num_tokens: float,
                 num_seqs: float) -> tuple[Tensor, dict[str, Tensor]]:
    """The training loss of one micro-batch and its metrics (detached scalars).

    ``num_tokens`` (sum of loss_mask) and ``num_seqs`` (number of samples) count
    the whole optimizer step across micro-batches and data-parallel ranks.
    loss = policy surrogate [* rollout-correction weight] + kl_loss_coef * KL(ref) - entropy_coef * entropy.
    A critic trains on :func:`value_loss` instead."""
    if num_tokens <= 0 or num_seqs <= 0:
        raise ValueError(f"compute_loss: num_tokens={num_tokens} and num_seqs={num_seqs} must be > 0 "
                         "(the global counts of the optimizer step)")
    b = _upcast(batch)
    mask = b.loss_mask

    def agg(x: Tensor) -> Tensor:
        return aggregate(x, mask, algo.loss_agg, num_tokens=num_tokens, num_seqs=num_seqs)

    if algo.loss_type == "sft":
        return sft_loss(b.log_probs, mask, loss_agg=algo.loss_agg, num_tokens=num_tokens, num_seqs=num_seqs)

    token_log_ratio = (b.log_probs - b.old_log_probs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    policy = policy_loss_of(algo)
    terms = policy.load()(PolicyLossInputs(log_probs=b.log_probs, old_log_probs=b.old_log_probs,
                                           log_ratio=token_log_ratio, advantages=b.advantages, loss_mask=mask,
                                           algo=algo, eps_clip_high=eps_clip_high))
    if not isinstance(terms, PolicyLossTerms):
        raise ValueError(f"algorithm.policy_loss {policy.name!r} returned a {type(terms).__name__}; return"
                         " PolicyLossTerms(loss, clipped, ratio) of [B, T] tensors")
    pg, clipped, ratio = terms.loss, terms.clipped, terms.ratio
    metrics = {name: agg(value) for name, value in terms.token_metrics.items()}

    if b.rollout_log_probs is not None:
        metrics["train_rollout_logprob_abs_diff"] = agg((b.old_log_probs - b.rollout_log_probs).abs())
    correction = rollout_correction_of(algo)
    if correction is not None:
        key = "rollout_correction" if algo.rollout_correction is not None else "use_tis"
        if b.rollout_log_probs is None:
            raise ValueError(f"algorithm.{key} needs the engine's log-probs: set LossBatch.rollout_log_probs")
        weight, corrected = apply_correction(correction.load(), correction.name, algo, b.old_log_probs,
                                             b.rollout_log_probs, mask, agg=agg, num_tokens=num_tokens,
                                             num_seqs=num_seqs)
        pg = pg * weight
        metrics.update(corrected)

    pg_loss = agg(pg)
    loss = pg_loss
    with torch.no_grad():
        metrics["pg_loss"] = pg_loss
        metrics["clip_frac"] = agg(clipped)
        metrics["ppo_kl"] = agg(-token_log_ratio)
        metrics["approx_kl"] = agg(torch.expm1(token_log_ratio) - token_log_ratio)
        metrics["ratio_mean"] = agg(ratio)
        metrics["ratio_max"], metrics["ratio_min"] = _masked_max_min(ratio, mask)

    if b.ref_log_probs is not None:
        kl = kl_estimate(b.log_probs, b.ref_log_probs, algo.kl_loss_type)
        kl_value = agg(kl)
        metrics["ref_kl"] = kl_value
        if algo.use_kl_loss:
            metrics["kl_loss"] = kl_value
            loss = loss + algo.kl_loss_coef * kl_value
    elif algo.use_kl_loss:
        raise ValueError("algorithm.use_kl_loss needs the reference log-probs: set LossBatch.ref_log_probs")

    if b.entropy is not None:
        entropy = agg(b.entropy)
        metrics["entropy"] = entropy
        loss = loss - algo.entropy_coef * entropy
    elif algo.entropy_coef != 0:
        raise ValueError("algorithm.entropy_coef is set but LossBatch.entropy is None; compute the entropy")

    metrics["loss"] = loss
    return loss, {name: value.detach() for name, value in metrics.items()}


def metric_reduction(name: str) -> str:
    """How a metric combines across micro-batches and ranks: ``"max"``, ``"min"``, ``"sum"``, or ``"cat"``
    (a ``*_dist`` metric: a tensor of values, NaN where there is none, concatenated)."""
    if name.endswith("_max"):
        return "max"
    if name.endswith("_min"):
        return "min"
    if name.endswith(DIST_SUFFIX):
        return "cat"
    return "sum"


def reduce_metrics(parts: Sequence[Mapping[str, Tensor | float]], *, final: bool = True) -> dict[str, Any]:
    """Combine the metrics of micro-batches (or ranks) into the step's metrics.

    With ``final`` (once the parts cover the whole step) each ``<name>_dist`` becomes its quantiles,
    ``<name>_p5``, ``<name>_p50``, ``<name>_p95`` (none when it holds no values), and every value is a float;
    without it the ``*_dist`` values stay float64 CPU tensors, for a further reduce_metrics over ranks."""
    out: dict[str, Any] = {}
    for part in parts:
        for name, value in part.items():
            how = metric_reduction(name)
            if how == "cat":
                value = torch.as_tensor(value).detach().reshape(-1).to("cpu", torch.float64)
                value = value[~value.isnan()]  # NaN: no value there (padding, untrained tokens)
                out[name] = torch.cat([out[name], value]) if name in out else value
                continue
            value = float(value)
            if name not in out:
                out[name] = value
            elif how == "max":
                out[name] = max(out[name], value)
            elif how == "min":
                out[name] = min(out[name], value)
            else:
                out[name] += value
    if final:
        for name in [n for n in out if metric_reduction(n) == "cat"]:
            values = out.pop(name)
            if values.numel():
                stem = name[: -len(DIST_SUFFIX)]
                for percent, value in zip(QUANTILES, quantiles(values), strict=True):
                    out[f"{stem}_p{percent}"] = value
    return out


def _masked_max_min(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    if x.numel() == 0:
        return x.new_tensor(float("-inf")), x.new_tensor(float("inf"))
    keep = mask > 0
    return (torch.where(keep, x, x.new_tensor(float("-inf"))).max(),
            torch.where(keep, x, x.new_tensor(float("inf"))).min())


def _upcast(batch: LossBatch) -> LossBatch:
    """Half-precision inputs are computed in float32 (exp and sums lose too much in bf16)."""

    def up(x: Tensor | None) -> Tensor | None:
        return x.float() if x is not None and x.dtype in (torch.bfloat16, torch.float16) else x

    return LossBatch(**{name: up(getattr(batch, name)) for name in batch.__dataclass_fields__})
