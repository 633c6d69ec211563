"""The registries of advantage estimators, policy losses and rollout corrections: the names the config
accepts, what each entry declares, and the user's own (``@register_advantage_estimator`` or ``module:attr``).

Standard library only: the config checks a name, and the placement asks whether a critic is
needed, without importing torch. A built-in's function is named by its ``module:attr`` and
imported on first use; docs/algorithms.md's tables are :func:`docs_table` of these registries.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from slime_rl.core.infra.plugins import PluginError, load_attr

# The attribute a registering decorator leaves on the function, so that `module:attr` naming it
# gets what it declared.
ENTRY_ATTR = "__slime_rl_registered__"


@dataclass(frozen=True)
class AdvantageEstimator:
    """An advantage estimator and what it declares. ``function(inputs: AdvantageInputs)`` returns the
    ``[B, T]`` advantages, or ``(advantages, returns)`` (core/algorithms/advantages.py)."""

    name: str
    function: Callable[..., Any] | str  # the function, or its `module:attr` (built-ins: imported on first use)
    groups: bool = False  # needs its prompt's group: the step is checked to hold each group as one run of n
    needs_critic: bool = False  # needs a critic's values: the run starts a critic trainer beside the actor
    needs_teacher: bool = False  # needs a teacher's log-probs of the sampled tokens (a `roles` entry, kind teacher)
    whitens: bool = False  # always whitened over the batch (else only with algorithm.normalize_advantages)
    policy_loss: str | None = None  # the policy loss it implies, over algorithm.policy_loss (gspo)
    summary: str = ""  # the formula, for docs/algorithms.md

    def load(self) -> Callable[..., Any]:
        return _load_function(self.function, "advantage estimator")


@dataclass(frozen=True)
class PolicyLoss:
    """A policy surrogate and what it declares. ``function(inputs: PolicyLossInputs)`` returns its
    per-token ``PolicyLossTerms`` (core/algorithms/losses.py); compute_loss aggregates them."""

    name: str
    function: Callable[..., Any] | str
    dual_clip: bool = False  # honours algorithm.eps_clip_c (the config refuses eps_clip_c with one that doesn't)
    summary: str = ""

    def load(self) -> Callable[..., Any]:
        return _load_function(self.function, "policy loss")


@dataclass(frozen=True)
class RolloutCorrection:
    """A correction of the trainer/engine mismatch and what it declares. ``function(inputs: CorrectionInputs)``
    returns its per-token ``CorrectionTerms`` (core/algorithms/rollout_correction.py); compute_loss multiplies
    the weight into the surrogate."""

    name: str
    function: Callable[..., Any] | str
    level: str = "token"  # the ratio it tests: each token's ("token") or its sequence's geometric mean ("sequence")
    masks: bool = False  # drops tokens or sequences outside [low, high] (uses algorithm.rollout_correction_low)
    summary: str = ""

    def load(self) -> Callable[..., Any]:
        return _load_function(self.function, "rollout correction")


Entry = TypeVar("Entry", AdvantageEstimator, PolicyLoss, RolloutCorrection)


def _load_function(function: Callable[..., Any] | str, what: str) -> Callable[..., Any]:
    return load_attr(function, what=what) if isinstance(function, str) else function


def _where(function: Callable[..., Any] | str) -> str:
    if isinstance(function, str):
        return function
    return f"{getattr(function, '__module__', '?')}:{getattr(function, '__qualname__', repr(function))}"


class Registry(Generic[Entry]):
    """Name -> entry for one config field; a ``module:attr`` value names a user's function."""

    def __init__(self, field: str, kind: type[Entry], what: str, call_form: str):
        self.field = field  # the config field whose values these are
        self.kind = kind
        self.what = what  # what an entry is, in messages
        self.call_form = call_form  # how the function is called, for signature errors
        self._entries: dict[str, Entry] = {}

    def register(self, entry: Entry) -> Entry:
        """Add ``entry``; a name taken by another function is refused (a built-in is not replaced)."""
        if ":" in entry.name or not entry.name:
            raise ValueError(f"{self.field}: {entry.name!r} cannot be registered; a name has no ':' (that"
                             " form is `module:attr`)")
        old = self._entries.get(entry.name)
        if old is not None and _where(old.function) != _where(entry.function):
            raise ValueError(f"{self.field}: {entry.name!r} is already registered by {_where(old.function)};"
                             " pick another name")
        self._entries[entry.name] = entry
        return entry

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __iter__(self) -> Iterator[Entry]:
        return iter(self._entries.values())

    def check_name(self, spec: str) -> str:
        """``spec`` if it is a registered name or has the `module:attr` form (loaded by :meth:`resolve`)."""
        if spec in self._entries or ":" in spec:
            return spec
        close = difflib.get_close_matches(spec, self._entries, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? Or" if close else "or"
        raise ValueError(f"unknown {spec!r} (registered: {', '.join(self.names())}); {hint} give"
                         " `module:attr` of your own function")

    def resolve(self, spec: str) -> Entry:
        """The entry a config value names. A `module:attr` is imported: a function registered with
        the decorator brings its declarations, a plain function declares nothing (the defaults)."""
        if ":" not in spec:
            try:
                return self._entries[self.check_name(spec)]
            except ValueError as err:
                raise PluginError(str(err)) from None
        found = load_attr(spec, what=self.what)
        if isinstance(found, self.kind):
            return found
        declared = getattr(found, ENTRY_ATTR, None)
        if isinstance(declared, self.kind):
            return declared
        check_signature(found, f"{self.what} {spec!r}", self.call_form)
        return self.kind(name=spec, function=found)


def check_signature(function: Any, what: str, call_form: str) -> None:
    """``function`` can be called with one positional argument, as ``call_form`` says it is."""
    if not callable(function):
        raise PluginError(f"{what} is a {type(function).__name__}, not a function; it is called as {call_form}")
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a builtin without a signature: trust it
        return
    try:
        signature.bind(None)
    except TypeError:
        raise PluginError(f"{what} takes {signature}; it is called as {call_form}") from None


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry(
    "algorithm.advantage_estimator", AdvantageEstimator, "advantage estimator",
    "fn(inputs: AdvantageInputs) -> advantages [B, T]")
POLICY_LOSSES: Registry[PolicyLoss] = Registry(
    "algorithm.policy_loss", PolicyLoss, "policy loss", "fn(inputs: PolicyLossInputs) -> PolicyLossTerms")
ROLLOUT_CORRECTIONS: Registry[RolloutCorrection] = Registry(
    "algorithm.rollout_correction", RolloutCorrection, "rollout correction",
    "fn(inputs: CorrectionInputs) -> CorrectionTerms")


def _registering(registry: Registry[Entry], name: str | None, declared: dict[str, Any]
                 ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def register(function: Callable[..., Any]) -> Callable[..., Any]:
        check_signature(function, f"{registry.what} {name or function.__name__!r}", registry.call_form)
        entry = registry.register(registry.kind(name=name or function.__name__, function=function, **declared))
        setattr(function, ENTRY_ATTR, entry)
        return function

    return register


def register_advantage_estimator(name: str | None = None, *, groups: bool = False, needs_critic: bool = False,
                                 whitens: bool = False, policy_loss: str | None = None, summary: str = "",
                                 needs_teacher: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register ``fn(inputs: AdvantageInputs)`` under ``name`` (default: the function's name) with what it
    declares. The config names it by that name in a process that imported it, or by `module:attr`
    anywhere (the trainer ranks import the module themselves)."""
    declared = dict(groups=groups, needs_critic=needs_critic, whitens=whitens, policy_loss=policy_loss,
                    summary=summary, needs_teacher=needs_teacher)
    return _registering(ADVANTAGE_ESTIMATORS, name, declared)


def register_policy_loss(name: str | None = None, *, dual_clip: bool = False, summary: str = ""
                         ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register ``fn(inputs: PolicyLossInputs) -> PolicyLossTerms`` under ``name``, as for estimators."""
    return _registering(POLICY_LOSSES, name, dict(dual_clip=dual_clip, summary=summary))


def register_rollout_correction(name: str | None = None, *, level: str = "token", masks: bool = False,
                                summary: str = "") -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register ``fn(inputs: CorrectionInputs) -> CorrectionTerms`` under ``name``, as for estimators."""
    if level not in ("token", "sequence"):
        raise ValueError(f"rollout correction {name!r}: level {level!r}; use 'token' or 'sequence'")
    return _registering(ROLLOUT_CORRECTIONS, name, dict(level=level, masks=masks, summary=summary))


def advantage_estimator_of(algo: Any) -> AdvantageEstimator:
    """The entry ``algorithm.advantage_estimator`` names (``algo``: an AlgorithmConfig)."""
    return ADVANTAGE_ESTIMATORS.resolve(algo.advantage_estimator)


def policy_loss_of(algo: Any) -> PolicyLoss:
    """The surrogate in use: the one the estimator implies (gspo), else ``algorithm.policy_loss``."""
    return POLICY_LOSSES.resolve(advantage_estimator_of(algo).policy_loss or algo.policy_loss)


def rollout_correction_of(algo: Any) -> RolloutCorrection | None:
    """The entry ``algorithm.rollout_correction`` names; ``use_tis`` is the built-in ``tis`` (its bound is
    ``tis_clip``); None when neither is set."""
    if algo.rollout_correction is not None:
        return ROLLOUT_CORRECTIONS.resolve(algo.rollout_correction)
    return ROLLOUT_CORRECTIONS.resolve("tis") if algo.use_tis else None


def docs_table(registry: Registry[Entry]) -> str:
    """The markdown table of ``registry``'s entries and their declarations (docs/algorithms.md)."""
    flags = [flag for flag in registry.kind.__dataclass_fields__ if flag not in ("name", "function", "summary")]
    header = ["value", *(flag.replace("_", " ") for flag in flags), "formula"]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for entry in registry:  # in registration order: the built-ins as registry.py lists them
        values = [getattr(entry, flag) for flag in flags]
        cells = ["yes" if v is True else "" if v in (False, None) else f"`{v}`" for v in values]
        rows.append("| " + " | ".join([f"`{entry.name}`", *cells, entry.summary]) + " |")
    return "\n".join(rows)


_ADVANTAGES = "slime_rl.core.algorithms.advantages:"
_LOSSES = "slime_rl.core.algorithms.losses:"
_CORRECTIONS = "slime_rl.core.algorithms.rollout_correction:"
_GROUP_KL = "The KL penalty (`kl_coef`) is charged to `r_i` as `sum_t m_t kl_t` before the baseline."
for _estimator in (
    AdvantageEstimator("grpo", _ADVANTAGES + "grpo_estimator", groups=True, summary=(
        "`A_i = (r_i - mean(r)) / (std(r) + 1e-6)`; `std` is the unbiased group std. `grpo_std_normalization:"
        f" false` drops the division, and so does `n = 1`. {_GROUP_KL} The default.")),
    AdvantageEstimator("dr_grpo", _ADVANTAGES + "dr_grpo_estimator", groups=True, summary=(
        "`A_i = r_i - mean(r)`: no std division. Dr. GRPO's other half, no per-sequence length normalisation,"
        " is the loss aggregation: use `loss_agg: token-mean` or `seq-mean-token-sum`, not"
        f" `seq-mean-token-mean`. {_GROUP_KL}")),
    AdvantageEstimator("gspo", _ADVANTAGES + "grpo_estimator", groups=True, policy_loss="gspo", summary=(
        "the GRPO advantage; it also selects GSPO's sequence-level ratio in the loss.")),
    AdvantageEstimator("rloo", _ADVANTAGES + "rloo_estimator", groups=True, summary=(
        "`A_i = r_i - (1/(n-1)) sum_{j != i} r_j = n/(n-1) (r_i - mean(r))`; needs `n >= 2`. " + _GROUP_KL)),
    AdvantageEstimator("reinforce_plus_plus", _ADVANTAGES + "reinforce_plus_plus_estimator", whitens=True,
                       summary=("token rewards `s_t = -kl_coef * kl_t`, plus `r_i` on the last trained token;"
                                " `A_t = G_t = s_t + gamma * G_{t+1}`.")),
    AdvantageEstimator("reinforce_plus_plus_baseline", _ADVANTAGES + "reinforce_plus_plus_baseline_estimator",
                       groups=True, whitens=True, summary="`A_t = (r_i - mean(r)) - kl_coef * kl_t`."),
    AdvantageEstimator("ppo", _ADVANTAGES + "gae_estimator", needs_critic=True, summary=(
        "token rewards as for REINFORCE++; GAE with the critic's `values`: `delta_t = s_t + gamma V_{t+1} - V_t`,"
        " `A_t = delta_t + gamma * lambd * A_{t+1}` (`V` is 0 past the end), `returns_t = A_t + V_t`. Config:"
        " `gamma`, `lambd`.")),
    AdvantageEstimator("opd", _ADVANTAGES + "opd_estimator", groups=True, needs_teacher=True, summary=(
        "on-policy distillation, per token: `A_t = opd_kl_coef * (log pi_T(y_t) - log pi_old(y_t))`, the negative"
        " reverse-KL sample of the student's own token against the teacher's (roles, kind teacher), plus"
        " `opd_reward_coef` times the GRPO advantage of the task reward; no discounting (docs/distillation.md).")),
):
    ADVANTAGE_ESTIMATORS.register(_estimator)

for _loss in (
    PolicyLoss("ppo", _LOSSES + "ppo_policy_loss", dual_clip=True, summary=(
        "`max(-A rho, -A clip(rho, 1 - eps_clip, 1 + eps_clip_high))`. `eps_clip_high` defaults to `eps_clip`;"
        " a larger one is DAPO's clip-higher. Where the clipped branch is taken the gradient is 0. The"
        " default.")),
    PolicyLoss("gspo", _LOSSES + "gspo_policy_loss", dual_clip=True, summary=(
        "the PPO form with the sequence ratio `rho_i = exp(mean_t m_t (log pi - log pi_old))`, the geometric"
        " mean of the token ratios, shared by all tokens of the sequence; gradient flows through the mean. GSPO"
        " uses small clip ranges (e.g. `eps_clip: 3e-4`, `eps_clip_high: 4e-4`) and `loss_agg:"
        " seq-mean-token-mean` to match the paper. Also selected by `advantage_estimator: gspo`.")),
    PolicyLoss("cispo", _LOSSES + "cispo_policy_loss", summary=(
        "`-sg(clip(rho, 1 - eps_clip, 1 + eps_clip_high)) * A * log pi(y_t)` (MiniMax-M1): the weight is under"
        " stop-gradient, so clipped tokens still pass gradient `-w A`. The paper has no lower bound: set"
        " `eps_clip >= 1`.")),
):
    POLICY_LOSSES.register(_loss)

for _correction in (
    RolloutCorrection("tis", _CORRECTIONS + "tis", summary=(
        "truncated IS: `w_t = min(q_t, high)`. `use_tis: true` is this entry with `high = tis_clip` (and keeps"
        " its `tis_weight_mean` / `tis_clipfrac` metrics).")),
    RolloutCorrection("icepop", _CORRECTIONS + "icepop", masks=True, summary=(
        "token-level masked IS (IcePop, MIS): `w_t = q_t * 1[low <= q_t <= high]`; a token outside the band"
        " contributes nothing.")),
    RolloutCorrection("seq-tis", _CORRECTIONS + "seq_tis", level="sequence", summary=(
        "sequence-level TIS: `w_t = min(g_i, high)` for every token of sequence `i`.")),
    RolloutCorrection("seq-mask-tis", _CORRECTIONS + "seq_mask_tis", level="sequence", masks=True, summary=(
        "sequence-level masked IS: `w_t = q_t * 1[low <= g_i <= high]`; a sequence whose geometric-mean"
        " ratio leaves the band contributes nothing, the tokens of the others keep their token ratio.")),
):
    ROLLOUT_CORRECTIONS.register(_correction)
