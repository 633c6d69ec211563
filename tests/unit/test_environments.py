"""The Environment contract (core/agent/environment.py): both built-in environments pass the conformance check, a
broken one does not, and the multi-turn loop drives an environment token-exactly (sampled ids as sampled, the
observations rendered by the chat template with loss mask 0, the step rewards summed)."""

from __future__ import annotations

import asyncio
import re

import pytest

from slime_rl.core.agent import MultiTurnGenerate
from slime_rl.core.agent.environment import (
    Environment,
    EnvironmentDone,
    GuessNumber,
    StepResult,
    ToolMath,
    env_reward,
    environment_factory,
)
from slime_rl.core.agent.template import TurnTemplate, encode, render
from slime_rl.core.agent.tools import Tool
from slime_rl.core.contracts import SamplingParams
from slime_rl.core.sample import Sample, SampleStatus
from slime_rl.core.testing import chat_tokenizer
from slime_rl.core.testing.environments import check_environment
from slime_rl.core.testing.standins import ScriptedEngine


def bisect(observations) -> str:
    """Binary search over the game's answers so far."""
    low, high, guess = 1, 100, None
    for text in observations[1:]:
        guess_prev = (low + high) // 2
        if isinstance(text, str) and text.startswith("Higher"):
            low = guess_prev + 1
        elif isinstance(text, str) and text.startswith("Lower"):
            high = guess_prev - 1
    guess = (low + high) // 2
    return f"My guess: {guess}"


def test_guess_number_passes_conformance():
    check_environment(GuessNumber, [Sample(index=i) for i in range(3)] + [Sample(index=9, label="73")], bisect)


def add(a: float, b: float) -> str:
    return str(a + b)


def test_tool_math_passes_conformance():
    def policy(observations) -> str:
        if len(observations) == 1:
            return '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
        return "The tool says 5, so \\boxed{5}"

    check_environment(lambda: ToolMath({"add": Tool("add", add, "add")}), [Sample(label="5"), Sample(label="6")],
                      policy)


def test_tool_math_rewards_the_right_answer():
    async def main():
        env = ToolMath({"add": Tool("add", add, "add")})
        await env.reset(Sample(label="5"))
        tool = await env.step('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')
        final = await env.step("\\boxed{5}")
        await env.reset(Sample(label="6"))
        wrong = await env.step("\\boxed{5}")
        return tool, final, wrong

    tool, final, wrong = asyncio.run(main())
    assert tool.observation == [{"role": "tool", "name": "add", "content": "5"}] and not tool.done
    assert (final.reward, final.done, wrong.reward, wrong.done) == (1.0, True, 0.0, True)


class Leaky(Environment):
    """Broken on purpose: the guesses are counted on the class, so episodes share them, and it never ends."""

    count = 0

    async def reset(self, sample):
        return "Say anything."

    async def step(self, action):
        Leaky.count += 1
        return StepResult(f"step {Leaky.count}", 0.0, False)


def test_conformance_catches_a_broken_environment():
    with pytest.raises(AssertionError) as caught:
        check_environment(Leaky, [Sample()], lambda seen: "x", max_steps=4)
    text = str(caught.value)
    assert "before reset did not raise" in text and "did not end within 4 steps" in text
    assert "another episode" in text


def test_environment_names_load_and_refuse_what_is_not_one():
    from slime_rl.core.infra.plugins import PluginError

    assert isinstance(environment_factory("guess_number")(), GuessNumber)
    with pytest.raises(PluginError, match="rollout.environment: 'chess'"):
        environment_factory("chess")
    with pytest.raises(PluginError, match="not an Environment subclass"):
        environment_factory("json:dumps")


def test_the_multi_turn_loop_drives_an_environment_token_exactly():
    tok = chat_tokenizer()
    generate = MultiTurnGenerate(tok, {}, max_turns=6, environment=lambda: GuessNumber(max_guesses=5))
    engine = ScriptedEngine(tok, ["50", "I say 25", "37"])
    sample = Sample(index=3, label="37", tokens=[1, 2, 3])
    out = asyncio.run(generate(sample, SamplingParams(max_new_tokens=400), engine))
    assert out.status == SampleStatus.COMPLETED and out.metadata["episode_end"] == "final_answer"
    assert out.metadata["env_reward"] == pytest.approx(0.8) and env_reward(out) == pytest.approx(0.8)
    # the prompt is the game's first observation, rendered as a user turn
    first = out.prompt[0]["content"]
    assert out.tokens[:out.prompt_length] == encode(tok, render(tok, [{"role": "user", "content": first}],
                                                                add_generation_prompt=True))
    template = TurnTemplate.from_tokenizer(tok)
    expected, mask = [], []
    for k, (inputs, ids) in enumerate(engine.calls):
        assert inputs == out.tokens[:len(inputs)]  # each turn saw the trajectory so far
        expected += ids
        mask += [1] * len(ids)
        if k < 2:
            obs = template.observation_ids([{"role": "user", "content": ["Lower.", "Higher."][k]}],
                                           ended_on_end_of_turn=True)
            expected += obs
            mask += [0] * len(obs)
    assert out.response_tokens == expected and out.loss_mask == mask
    assert re.search(r"Lower\..*Higher\.", tok.decode(out.response_tokens), re.S)


def test_step_after_the_end_is_refused():
    async def main():
        env = GuessNumber(max_guesses=1)
        await env.reset(Sample(label="3"))
        await env.step("4")
        await env.step("3")

    with pytest.raises(EnvironmentDone):
        asyncio.run(main())
