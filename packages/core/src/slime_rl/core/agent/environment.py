"""The `Environment` contract: ``reset(sample) -> observation``, ``step(action) -> observation, reward, done``, as
NeMo-Gym, OpenRLHF's ``AgentInstanceBase``, verl's interactions and OpenEnv define it, driven by the built-in
multi-turn loop (``rollout.generate_fn: environment``, ``rollout.environment: <name or module:attr>``).

The loop samples an assistant turn from the ids (loss mask 1, as sampled), hands the environment the turn's text
(decoded only to read it), and appends the observation the environment returns, rendered by the chat template
in the environment's ``observation_role`` and tokenised with its text as plain text (loss mask 0), until the
environment says ``done``, ``rollout.max_turns`` turns or the response budget run out. The rewards of the steps
add up in ``sample.metadata["env_reward"]``; ``rollout.reward: slime_rl.core.agent.environment:env_reward``
trains on them.

Built in: ``tool_math`` (examples/agent_tool_math.yaml's task as an environment: the model's tool calls run, and
its final answer is checked against the label) and ``guess_number`` (a text game: find a number by guesses
answered with higher / lower). `slime_rl.core.testing.environments.check_environment` is the conformance check
every environment should pass.
"""

from __future__ import annotations

import asyncio
import random
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from slime_rl.core.agent.tool_calls import parse_tool_calls
from slime_rl.core.agent.tools import Tool, call_tool, load_tools
from slime_rl.core.sample import Sample

if TYPE_CHECKING:
    from slime_rl.core.config import Config

Observation = str | list[dict[str, Any]] | None  # text in observation_role, chat messages, or nothing


@dataclass
class StepResult:
    observation: Observation  # what the model sees next (ignored once done)
    reward: float = 0.0
    done: bool = False


class EnvironmentDone(RuntimeError):
    """`Environment.step` after the episode ended, or before `reset`."""


class Environment(ABC):
    """One episode's world. A fresh instance per episode (`from_config` builds it); methods are coroutines."""

    #: the chat role observations given as text are rendered in ("user", or "tool" for tool results)
    observation_role: ClassVar[str] = "user"

    @classmethod
    def from_config(cls, cfg: Config | None) -> Environment:
        return cls()

    @abstractmethod
    async def reset(self, sample: Sample) -> Observation:
        """Start an episode for ``sample``: None keeps the sample's prompt; text or chat messages replace it
        (rendered with the chat template and a generation prompt)."""

    @abstractmethod
    async def step(self, action: str) -> StepResult:
        """The model's turn (its text); raises `EnvironmentDone` after ``done`` or before `reset`."""


def env_reward(sample: Sample) -> float:
    """``rollout.reward: slime_rl.core.agent.environment:env_reward``: the episode's summed step rewards."""
    if "env_reward" not in sample.metadata:
        raise ValueError("the episode has no env_reward; use it with rollout.generate_fn: environment")
    return float(sample.metadata["env_reward"])


class GuessNumber(Environment):
    """Find a number from 1 to ``high`` in at most ``max_guesses`` guesses; each wrong guess is answered "higher"
    or "lower". Reward 1 for finding it, less 0.1 per guess after the first; 0 when the guesses run out. The
    number is the sample's label when it is one, else drawn from the sample's index (the same every reset)."""

    def __init__(self, high: int = 100, max_guesses: int = 7):
        self.high, self.max_guesses = high, max_guesses
        self.secret: int | None = None
        self.guesses = 0
        self.done = False

    async def reset(self, sample: Sample) -> Observation:
        label = str(sample.label).strip() if sample.label is not None else ""
        self.secret = int(label) if label.isdigit() else random.Random(sample.index).randint(1, self.high)
        self.guesses, self.done = 0, False
        return (f"I am thinking of a number from 1 to {self.high}. Guess it: reply with one number. After each wrong"
                f" guess I say higher or lower. You have {self.max_guesses} guesses.")

    async def step(self, action: str) -> StepResult:
        if self.secret is None or self.done:
            raise EnvironmentDone("guess_number: the episode is over (or was never reset)")
        found = re.search(r"-?\d+", action)
        if found is None:
            return self._after_guess("Reply with one number.", counted=False)
        guess = int(found.group())
        self.guesses += 1
        if guess == self.secret:
            self.done = True
            return StepResult(f"Correct, it is {guess}.", max(0.0, 1.0 - 0.1 * (self.guesses - 1)), True)
        return self._after_guess("Higher." if guess < self.secret else "Lower.", counted=True)

    def _after_guess(self, text: str, *, counted: bool) -> StepResult:
        if not counted:
            self.guesses += 1  # an unreadable reply costs a guess too: no endless episodes
        if self.guesses >= self.max_guesses:
            self.done = True
            return StepResult(f"{text} No guesses left; it was {self.secret}.", 0.0, True)
        return StepResult(text, 0.0, False)


class ToolMath(Environment):
    """examples/agent_tool_math.yaml's task: the prompt (the data's) asks for a ``\\boxed{}`` answer and offers
    tools; a turn with tool calls gets their results as ``tool`` messages, a turn without ends the episode, with
    reward 1 when its answer equals the label (the built-in ``math`` reward's check)."""

    observation_role = "tool"

    def __init__(self, tools: dict[str, Tool] | None = None, tool_timeout: float = 30.0, cfg: Config | None = None):
        self.tools = tools if tools is not None else load_tools(["python"], cfg)
        self.tool_timeout = tool_timeout
        self.sample: Sample | None = None
        self.done = False

    @classmethod
    def from_config(cls, cfg: Config | None) -> Environment:
        if cfg is None:
            return cls()
        specs = list(cfg.rollout.tools) or ["python"]
        return cls(load_tools(specs, cfg), cfg.rollout.tool_timeout, cfg)

    async def reset(self, sample: Sample) -> Observation:
        self.sample, self.done = sample, False
        return None

    async def step(self, action: str) -> StepResult:
        if self.sample is None or self.done:
            raise EnvironmentDone("tool_math: the episode is over (or was never reset)")
        calls = parse_tool_calls(action)
        if calls:
            results = await asyncio.gather(*(call_tool(self.tools, c, self.tool_timeout) for c in calls))
            return StepResult([{"role": "tool", "name": r.name, "content": r.text} for r in results])
        self.done = True
        from slime_rl.core.rewards.math_answer import math_reward

        return StepResult(None, await math_reward(Sample(response=action, label=self.sample.label)), True)


BUILTIN_ENVIRONMENTS: dict[str, type[Environment]] = {"tool_math": ToolMath, "guess_number": GuessNumber}


def environment_factory(spec: str, cfg: Config | None = None) -> Callable[[], Environment]:
    """``rollout.environment``: a built-in name or ``module:attr`` of an `Environment` subclass; returns a maker of
    fresh instances."""
    from slime_rl.core.infra.plugins import PluginError, load_attr

    if spec in BUILTIN_ENVIRONMENTS:
        cls = BUILTIN_ENVIRONMENTS[spec]
    elif ":" in spec:
        cls = load_attr(spec, what="environment")
    else:
        raise PluginError(f"rollout.environment: {spec!r}: give module:attr or a built-in environment"
                          f" ({', '.join(BUILTIN_ENVIRONMENTS)})")
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise PluginError(f"rollout.environment: {spec!r} is not an Environment subclass"
                          " (slime_rl.core.agent.environment.Environment)")
    return lambda: cls.from_config(cfg)
