"""The gateway's generate function under the rollout's own machinery: groups scored from what the agent returned,
episodes the rollout aborts (it had enough groups) back in the buffer from their prompt, with partial_rollout on
too, and resumed later as fresh episodes; a weight update between an episode's calls kept per token (fully async)."""

from __future__ import annotations

import asyncio

import pytest

# The gateway is core's optional extra (slime-rl-core[gateway], aiohttp); its tests drive it with the openai
# package (the test extra). Core installed alone has neither: these tests are the extra's.
pytest.importorskip("aiohttp", reason="the gateway extra: pip install slime-rl-core[gateway]")
openai = pytest.importorskip("openai", reason="the test extra: pip install slime-rl-core[test]")

from test_rollout import ListBuffer, ListSource, make_cfg  # noqa: E402

from slime_rl.core.agent.template import encode  # noqa: E402
from slime_rl.core.contracts import GenerateOutput, RolloutEngine, SamplingParams  # noqa: E402
from slime_rl.core.gateway import GatewayGenerate, episode_samples  # noqa: E402
from slime_rl.core.run.rollout import RolloutRunner  # noqa: E402
from slime_rl.core.sample import Sample, SampleStatus  # noqa: E402
from slime_rl.core.testing import chat_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return chat_tokenizer()


class ChatEngine(RolloutEngine):
    """Answers every call with "ok" at once, except prompts about 'slow', which decode until aborted."""

    def __init__(self, tokenizer):
        self.tokenizer, self.version, self.aborted = tokenizer, 0, asyncio.Event()
        self.slow = True  # False: 'slow' prompts answer at once too
        self.request_ids: list[str] = []

    async def generate(self, input_ids, params, request_id=None):
        self.request_ids.append(request_id)
        if self.slow and "slow" in self.tokenizer.decode(input_ids) and not self.aborted.is_set():
            await self.aborted.wait()
            ids = encode(self.tokenizer, "partial")
            return GenerateOutput(ids, [-0.5] * len(ids), "abort", self.version)
        ids = encode(self.tokenizer, "ok") + [self.tokenizer.eos_token_id]
        return GenerateOutput(ids, [-0.1] * len(ids), "stop", self.version)

    async def abort(self, request_id=None):
        self.aborted.set()

    async def update_weights(self, named_tensors, *, version, last):
        self.version = version

    @property
    def weight_version(self):
        return self.version


async def two_calls(base_url, api_key, sample):
    """Two chat calls; the reward is 1 when both answered."""
    topic = "slow" if sample.label == "9" else "fast"
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as api:
        messages = [{"role": "user", "content": f"a {topic} question"}]
        answers = 0
        for _ in range(2):
            reply = (await api.chat.completions.create(model="policy", messages=messages)).choices[0].message
            answers += reply.content == "ok"
            messages += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": "again"}]
    return float(answers == 2)


async def agent_reward_here(sample: Sample) -> float:
    return sample.metadata["agent_reward"]


@pytest.mark.parametrize("partial", [False, True])
def test_aborted_episodes_go_back_from_their_prompt_and_resume(tok, partial):
    cfg = make_cfg(rollout__over_sampling_batch_size=3, rollout__partial_rollout=partial,
                   rollout__max_response_len=64, rollout__reward=f"{__name__}:agent_reward_here")
    engine = ChatEngine(tok)
    runner = RolloutRunner(cfg, engine, tok.decode)
    runner.generate_fn = GatewayGenerate(tok, agent=two_calls, agent_timeout=30)
    buffer, source = ListBuffer(), ListSource([1, 2, 9], 2)

    async def main():
        first = await runner.rollout(source, buffer)
        engine.slow = False
        waiting = [(s.status, s.response_length, list(s.tokens)) for g in buffer.groups for s in g]
        second = await runner.rollout(ListSource([], 2), buffer)
        await runner.generate_fn.gateway.stop()
        return first, waiting, second

    first, waiting, second = asyncio.run(main())
    assert sorted(g[0].group_index for g in first.groups) == [1, 2]
    assert all(s.reward == 1.0 and s.metadata["turns"] == 2 for g in first.groups for s in g)
    # the slow group was aborted mid-episode: back in the buffer as its prompt, whatever partial_rollout says
    # (partial_rollout keeps an ABORTED sample as it is; without, the rollout resets it to PENDING)
    assert waiting == [(SampleStatus.ABORTED if partial else SampleStatus.PENDING, 0, [9])] * 2
    # resumed on the next rollout as new episodes, finished and scored ("slow" answers at once now)
    (resumed,) = second.groups
    assert resumed[0].group_index == 9 and all(s.status == SampleStatus.COMPLETED for s in resumed)
    assert all(s.metadata["episode_end"] == "final_answer" for s in resumed)
    episodes = {rid.split("/")[0] for rid in engine.request_ids}
    assert len(episodes) == 3 * 2 + 2  # every episode its own routing key; the resumed ones new


def test_a_weight_update_between_calls_is_kept_per_token(tok):
    """Fully async: the engine's version moves while an episode runs; the trajectory keeps each token's version."""
    engine = ChatEngine(tok)

    async def agent(base_url, api_key, sample):
        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as api:
            messages = [{"role": "user", "content": "hi"}]
            reply = (await api.chat.completions.create(model="policy", messages=messages)).choices[0].message
            engine.version = 5  # a weight sync lands between the two calls
            messages += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": "again"}]
            await api.chat.completions.create(model="policy", messages=messages)

    async def main():
        fn = GatewayGenerate(tok, agent=agent)
        out = await fn(Sample(index=1, tokens=[1]), SamplingParams(max_new_tokens=64), engine)
        await fn.gateway.stop()
        return out

    out = asyncio.run(main())
    first_len = len(encode(tok, "ok")) + 1
    trained_versions = [v for v, m in zip(out.token_versions, out.loss_mask, strict=True) if m]
    assert trained_versions == [0] * first_len + [5] * first_len and out.weight_version == 0
    assert episode_samples  # the module's entry point stays importable for users building their own
