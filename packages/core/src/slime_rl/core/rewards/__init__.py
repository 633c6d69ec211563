"""Rewards: the built-in registry, loading by name or ``module:attr``, and the concurrent scorer.

A reward is ``async def reward(sample) -> float | dict[str, float]`` (plain
``def`` works too), or with ``rollout.group_reward`` a group reward
``async def reward(samples) -> list[...]`` over one prompt's samples.
It reads ``sample.response`` (text), ``sample.label`` and ``sample.metadata``.

A user's reward (``module:attr``) runs in a pool of worker processes
(:mod:`slime_rl.core.infra.workers`, ``rollout.reward_workers`` of them), an ``async def``
one in the worker's own event loop: one that blocks (``time.sleep``, ``requests``)
or hangs is killed at ``rollout.reward_timeout`` and its worker replaced. Changes it
makes to a sample stay in the worker; what counts is what it returns. Built-in
rewards are async and run here.

:func:`score_samples` runs at most ``rollout.reward_concurrency`` calls at a
time, each under ``rollout.reward_timeout`` seconds. A call that raises, times
out or returns something that is not a reward marks its samples FAILED with
``metadata["error"]`` saying why, and scores them 0.0 (``on_reward_failure:
zero``) or None (``drop``: the orchestrator drops the group); the rest score normally.
A reward that is not finite, or whose magnitude exceeds :data:`MAX_REWARD_MAGNITUDE`,
fails its sample the same way: beyond that, a group's variance or a step's mean
overflows float64 and the advantages or metrics would be garbage (or the run crash).
How many may fail before the step fails: ``rollout.max_failed_fraction`` (rollout.py).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from slime_rl.core.config import RolloutConfig
from slime_rl.core.config.secrets import Secret, redact
from slime_rl.core.infra.plugins import PluginError, load_function
from slime_rl.core.infra.workers import UserCodeError, UserCodeLoadError, is_user_code, user_code_pool
from slime_rl.core.rewards.code_tests import CodeTestsReward
from slime_rl.core.rewards.math_answer import dapo_reward, deepscaler_reward, math_reward
from slime_rl.core.rewards.remote import RemoteReward
from slime_rl.core.rewards.text_match import exact_match_reward, f1_reward
from slime_rl.core.roles.reward_model import reward_model_reward
from slime_rl.core.sample import Reward, Sample, SampleStatus
from slime_rl.core.sandbox import SandboxSettings

logger = logging.getLogger(__name__)

BUILTIN_REWARDS: dict[str, Callable[..., Any]] = {
    "math": math_reward,
    "dapo": dapo_reward,
    "deepscaler": deepscaler_reward,
    "exact_match": exact_match_reward,
    "f1": f1_reward,
    "remote": RemoteReward,  # needs rollout.reward_url; built by load_reward
    "code_tests": CodeTestsReward,  # runs code in the sandbox (rollout.sandbox); built by load_reward
    "reward_model": reward_model_reward,  # the run's reward-model role (roles, kind reward_model), batched
}

__all__ = ["BUILTIN_REWARDS", "MAX_REWARD_MAGNITUDE", "CodeTestsReward", "RemoteReward", "load_reward",
           "score_samples"]

#: The largest ``|reward|`` the scorer accepts. Its square summed over any batch stays far inside
#: float64 (and the value itself inside float32), so group statistics, whitening and metrics stay
#: finite; a real reward this large is a bug or needs rescaling.
MAX_REWARD_MAGNITUDE = 1e30


def load_reward(spec: str, *, group: bool, reward_url: str | None = None, sandbox: Any = None,
                reward_api_key: Secret | None = None) -> Callable[..., Any]:
    """The reward ``spec`` names: a built-in (``math``, ``dapo``, ``deepscaler``, ``exact_match``,
    ``f1``, ``remote``, ``code_tests``) or ``module:attr``. ``group=True`` expects a group reward
    (``module:attr`` only). ``sandbox``: the ``rollout.sandbox`` section code_tests runs under;
    ``reward_api_key``: the key ``remote`` sends as a bearer token."""
    if spec in BUILTIN_REWARDS and group:
        raise PluginError(f"rollout.group_reward: the built-in reward {spec!r} scores one sample at a time; "
                          "set rollout.group_reward=false, or give a group reward as module:attr")
    if spec == "remote":
        if not reward_url:
            raise PluginError("rollout.reward_url: the remote reward posts to a URL; set rollout.reward_url="
                              "http://host:port/path")
        return RemoteReward(reward_url, api_key=reward_api_key)
    if spec == "code_tests":
        return CodeTestsReward(SandboxSettings.from_section(sandbox) if sandbox is not None else None)
    return load_function(spec, BUILTIN_REWARDS, what="reward")


async def score_samples(samples: list[Sample], rollout_cfg: RolloutConfig) -> None:
    """Set ``sample.reward`` for every sample (see the module docstring for failures)."""
    if not samples:
        return
    cfg = rollout_cfg
    call = _reward_caller(cfg)
    limit = asyncio.Semaphore(cfg.reward_concurrency)
    units = _groups(samples) if cfg.group_reward else [[s] for s in samples]
    failures: list[str] = []

    def fail(unit: list[Sample], reason: str) -> None:
        reason = redact(" ".join(reason.split()))[:500]  # one line, no key or URL credentials in it
        failures.append(reason)
        for sample in unit:
            sample.status = SampleStatus.FAILED
            sample.metadata["error"] = reason
            sample.reward = 0.0 if cfg.on_reward_failure == "zero" else None

    async def score(unit: list[Sample]) -> None:
        async with limit:
            try:
                result = await call(unit if cfg.group_reward else unit[0])
            except TimeoutError:
                fail(unit, f"reward {cfg.reward!r} timed out after {cfg.reward_timeout:g} s")
                return
            except UserCodeLoadError as err:  # the reward itself is missing: every call would fail alike
                raise PluginError(f"rollout.reward: {cfg.reward!r} does not load: {err}") from None
            except UserCodeError as err:  # raised in the worker, or the worker died
                fail(unit, f"reward {cfg.reward!r} {err}")
                return
            except Exception as err:  # the user's reward failing costs only its samples
                fail(unit, f"reward {cfg.reward!r} raised {type(err).__name__}: {err}")
                return
        try:
            rewards = _check_result(result, len(unit), cfg)
        except ValueError as err:
            fail(unit, f"reward {cfg.reward!r} returned an unusable result: {err}")
            return
        for sample, reward in zip(unit, rewards, strict=True):
            sample.reward = reward

    await asyncio.gather(*(score(unit) for unit in units))
    if failures:
        logger.warning("%d of %d reward calls failed; first: %s", len(failures), len(units), failures[0])


def reward_workers(cfg: RolloutConfig) -> int:
    """How many worker processes run a user's reward (and filter) calls; 0: none, they run here."""
    if cfg.reward_workers is not None:
        return cfg.reward_workers
    return min(cfg.reward_concurrency, 8, max(2, os.cpu_count() or 2))


def _reward_caller(cfg: RolloutConfig) -> Callable[[Any], Awaitable[Any]]:
    """``call(sample_or_group) -> result``, raising TimeoutError after ``reward_timeout``."""
    if is_user_code(cfg.reward) and reward_workers(cfg) > 0:
        pool = user_code_pool(reward_workers(cfg))
        return lambda arg: pool.acall(cfg.reward, (arg,), cfg.reward_timeout)
    # Built-ins (async, well behaved), or the user's own with reward_workers=0 (no isolation: for
    # debugging; a blocking async reward then blocks the rollout, and a hung plain one keeps its thread).
    reward_fn = load_reward(cfg.reward, group=cfg.group_reward, reward_url=cfg.reward_url, sandbox=cfg.sandbox,
                            reward_api_key=cfg.reward_api_key)

    async def call(arg: Any) -> Any:
        if inspect.iscoroutinefunction(reward_fn) or inspect.iscoroutinefunction(type(reward_fn).__call__):
            result = reward_fn(arg)
        else:
            result = asyncio.to_thread(reward_fn, arg)
        result = await asyncio.wait_for(result, cfg.reward_timeout)
        return await result if inspect.isawaitable(result) else result

    return call


def _groups(samples: list[Sample]) -> list[list[Sample]]:
    """Consecutive runs of samples sharing group_index."""
    groups: list[list[Sample]] = []
    for s in samples:
        if groups and groups[-1][0].group_index == s.group_index:
            groups[-1].append(s)
        else:
            groups.append([s])
    return groups


def _check_result(result: Any, size: int, cfg: RolloutConfig) -> list[Reward]:
    """The rewards of one call as a list, or ValueError saying what is wrong with them."""
    if cfg.group_reward:
        if not isinstance(result, list | tuple) or len(result) != size:
            got = f"{len(result)} rewards" if isinstance(result, list | tuple) else type(result).__name__
            raise ValueError(f"a group reward must return a list of {size} rewards, got {got}")
        values = list(result)
    else:
        values = [result]
    return [_check_one(v, cfg.reward_key) for v in values]


def _check_one(value: Any, key: str | None) -> Reward:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return _checked_number(value, "reward")
    if isinstance(value, dict) and value and all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in value.values()):
        if key is None:
            raise ValueError(f"reward is a dict with keys {sorted(value)}; set rollout.reward_key to one")
        if key not in value:
            raise ValueError(f"reward dict has no key {key!r} (rollout.reward_key); it has {sorted(value)}")
        _checked_number(value[key], f"reward[{key!r}]")
        too_big = [k for k, v in value.items() if abs(v) > sys.float_info.max]  # ints: float() would raise
        if too_big:
            raise ValueError(f"reward[{too_big[0]!r}] is an integer too large for a float")
        return {str(k): float(v) for k, v in value.items()}
    raise ValueError(f"a reward is a number or a dict of numbers, got {type(value).__name__} {value!r:.80}")


def _checked_number(value: int | float, what: str) -> float:
    """``value`` as a float, or ValueError when it is not finite or beyond MAX_REWARD_MAGNITUDE."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{what} is {value}; a reward must be a finite number")
    if abs(value) > MAX_REWARD_MAGNITUDE:  # compared before float(): an int may not fit one
        shown = f"{value:g}" if abs(value) <= sys.float_info.max else f"an integer of {value.bit_length()} bits"
        raise ValueError(f"{what} is {shown}, beyond the bound |reward| <= {MAX_REWARD_MAGNITUDE:g} that keeps "
                         "advantages and metrics finite; scale the reward down")
    return float(value)
