"""``roles``: the extra models a run serves beside the policy: a teacher (on-policy distillation), a reward
model (a scalar head) and generative judges. Each is frozen (no weight sync ever reaches it), served by its
own engine (``hf`` on the CPU, ``sglang`` on GPUs), placed by the run's placement plan, started,
health-checked, restarted and stopped with the run (core/run/role_workers.py). docs/roles.md has the config.

Standard library and pydantic only: the config loads, and ``slime-cli plan`` places roles, without torch.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from slime_rl.core.config.errors import ConfigError
from slime_rl.core.config.secrets import Secret

RoleKind = Literal["teacher", "reward_model", "judge"]


class RoleConfig(BaseModel):
    """One served model, ``roles.<name>``: what it is, where its weights are, how it is served."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False)

    kind: RoleKind  # teacher: log-probs for OPD; reward_model: a scalar score; judge: generates a verdict
    path: str  # an HF folder (or builtin:<name>); a reward model is a `...ForSequenceClassification` with one label
    tokenizer_path: str | None = None  # defaults to path
    engine: Literal["hf", "sglang"] = "hf"  # hf: in a process of its own (CPU, one GPU); sglang: a server (GPUs)
    num_gpus: int = Field(1, ge=1)  # the engine's GPUs (its tensor-parallel size); a process slot on the CPU
    colocate: bool = False  # share the rollout engines' first GPUs instead of taking GPUs of its own
    engine_args: dict[str, Any] = Field(default_factory=dict)  # sglang: server flags (mem_fraction_static, ...)
    api_key: Secret | None = None  # the key its server demands (sent as a bearer token); unset: a fresh one
    timeout_s: float = Field(60.0, gt=0)  # one request, before a retry
    attempts: int = Field(3, ge=1)  # tries per request: connection errors, timeouts, 429 and 5xx are retried
    batch_size: int = Field(32, ge=1)  # reward model: samples per classify request; teacher: per prefill request
    max_new_tokens: int = Field(64, ge=1)  # judge: the default length of a verdict
    health_interval_s: float = Field(30.0, gt=0)  # seconds between health checks during the run
    max_restarts: int = Field(3, ge=0)  # a role that dies is restarted this many times in a run, then the run fails
    startup_timeout_s: float = Field(600.0, gt=0)


def roles_of_kind(roles: dict[str, RoleConfig], kind: RoleKind) -> list[str]:
    return [name for name, role in roles.items() if role.kind == kind]


def the_role(roles: dict[str, RoleConfig], kind: RoleKind, needed_by: str) -> str:
    """The name of the one role of ``kind``; a ConfigError naming ``needed_by`` when there is none or several."""
    names = roles_of_kind(roles, kind)
    if len(names) == 1:
        return names[0]
    if not names:
        raise ConfigError("roles", f"{needed_by} needs a role of kind {kind}; add roles.<name>: {{kind: {kind},"
                                   " path: <HF folder>}")
    raise ConfigError("roles", f"{needed_by} uses the one role of kind {kind}, but there are {len(names)}"
                               f" ({', '.join(names)}); keep one")


def check_role_names(roles: dict[str, RoleConfig]) -> None:
    """A role's name becomes part of environment variables and URLs: letters, digits and '_' only."""
    for name in roles:
        if not name.replace("_", "").isalnum() or not name.isascii() or name[0].isdigit():
            raise ConfigError(f"roles.{name}", "a role's name takes letters, digits and '_' (not first a digit);"
                                               " rename it")


def check_roles(cfg: Any) -> None:
    """What the roles must be for the rest of the config (``cfg``: a Config): the estimator's teacher, the
    reward model the ``reward_model`` reward reads, folders that exist."""
    from pathlib import Path

    from slime_rl.core.algorithms.registry import advantage_estimator_of

    check_role_names(cfg.roles)
    try:
        needs_teacher = advantage_estimator_of(cfg.algorithm).needs_teacher
    except Exception:  # noqa: BLE001 - an estimator that does not load is check_algorithm's to report
        needs_teacher = False
    if needs_teacher:
        the_role(cfg.roles, "teacher", f"algorithm.advantage_estimator={cfg.algorithm.advantage_estimator}")
    if cfg.rollout.reward == "reward_model":
        the_role(cfg.roles, "reward_model", "rollout.reward=reward_model")
    for name, role in cfg.roles.items():
        for key in ("path", "tokenizer_path"):
            folder = getattr(role, key)
            if folder is not None and not folder.startswith("builtin:") and not Path(folder).is_dir():
                raise ConfigError(f"roles.{name}.{key}", f"{folder} is not a folder (no model hub here: give a local"
                                                         " HF folder)")
