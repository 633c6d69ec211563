"""Conformance of an `Environment` (core/agent/environment.py): what the multi-turn loop relies on, checked the way
`testing.conformance` checks engines. Run it from your tests::

    from slime_rl.core.testing.environments import check_environment
    check_environment(MyEnv, [sample], policy=lambda observations: "my next action")

``policy`` maps the observations so far to the next action; it should finish an episode within ``max_steps``.
Every check is run; `check_environment` raises one AssertionError listing each that failed.
"""

from __future__ import annotations

import asyncio
import copy
import math
from collections.abc import Callable
from typing import Any

from slime_rl.core.agent.environment import Environment, EnvironmentDone, Observation, StepResult
from slime_rl.core.sample import Sample

Policy = Callable[[list[Observation]], str]


def _observation_problem(observation: Any, where: str) -> str | None:
    if observation is None or isinstance(observation, str):
        return None
    if isinstance(observation, list) and observation and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in observation):
        return None
    return f"{where}: {observation!r:.80} is not None, a str or a non-empty list of {{role, content}} messages"


async def _episode(env: Environment, sample: Sample, policy: Policy, max_steps: int,
                   problems: list[str], name: str) -> list[tuple[Any, float, bool]]:
    first = await env.reset(copy.deepcopy(sample))
    if (p := _observation_problem(first, f"{name}: reset")) is not None:
        problems.append(p)
    seen, trace = [first], []
    for k in range(max_steps):
        result = await env.step(policy(seen))
        if not isinstance(result, StepResult):
            problems.append(f"{name}: step {k} returned {type(result).__name__}, not a StepResult")
            return trace
        if not isinstance(result.reward, (int, float)) or not math.isfinite(result.reward):
            problems.append(f"{name}: step {k} reward {result.reward!r} is not a finite number")
        if not isinstance(result.done, bool):
            problems.append(f"{name}: step {k} done is {type(result.done).__name__}, not a bool")
        if not result.done and (p := _observation_problem(result.observation, f"{name}: step {k}")) is not None:
            problems.append(p)
        trace.append((result.observation, float(result.reward), bool(result.done)))
        seen.append(result.observation)
        if result.done:
            return trace
    problems.append(f"{name}: the episode did not end within {max_steps} steps of the policy")
    return trace


def check_environment(make: Callable[[], Environment], samples: list[Sample], policy: Policy, *,
                      max_steps: int = 16) -> None:
    """Check ``make()``'s environments on ``samples`` under ``policy``: observations and results of the contract's
    types; an episode that ends; `EnvironmentDone` from a step before reset and after done; the same sample and
    actions give the same episode (reset starts afresh); two instances at once do not share state."""
    asyncio.run(_check(make, samples, policy, max_steps))


async def _check(make: Callable[[], Environment], samples: list[Sample], policy: Policy, max_steps: int) -> None:
    problems: list[str] = []
    fresh = make()
    if not isinstance(fresh, Environment):
        raise AssertionError(f"make() returned {type(fresh).__name__}, not an Environment")
    try:
        await fresh.step("anything")
        problems.append("step before reset did not raise EnvironmentDone")
    except EnvironmentDone:
        pass
    for n, sample in enumerate(samples):
        name = f"sample {n}"
        env = make()
        trace = await _episode(env, sample, policy, max_steps, problems, name)
        if trace and trace[-1][2]:
            try:
                await env.step("anything")
                problems.append(f"{name}: step after done did not raise EnvironmentDone")
            except EnvironmentDone:
                pass
        again = await _episode(env, sample, policy, max_steps, [], name)  # reset on the used instance
        if again != trace:
            problems.append(f"{name}: reset and the same actions gave another episode: {again!r:.120} vs {trace!r:.120}")
        # two instances stepped in turns give what each gives alone
        a, b = make(), make()
        other = samples[(n + 1) % len(samples)]
        first_a, first_b = await a.reset(copy.deepcopy(sample)), await b.reset(copy.deepcopy(other))
        seen_a, seen_b, got = [first_a], [first_b], []
        for _ in range(max_steps):
            result_a = await a.step(policy(seen_a))
            got.append((result_a.observation, float(result_a.reward), bool(result_a.done)))
            seen_a.append(result_a.observation)
            if result_a.done:
                break
            try:
                result_b = await b.step(policy(seen_b))
                seen_b.append(result_b.observation)
            except EnvironmentDone:
                pass
        if got != trace:
            problems.append(f"{name}: another instance's episode running alongside changed this one's")
    if problems:
        raise AssertionError("environment conformance:\n  " + "\n  ".join(problems))
