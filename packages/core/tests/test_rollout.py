"""Rollout orchestration over a scripted engine: over-sampling, filtering, abort, partial rollout,
custom generate functions and eval. The engine here is a test double of the RolloutEngine
contract; the real engines have their own tests and the end-to-end tests use them."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from slime_rl.core.config import Config
from slime_rl.core.contracts import Buffer, DataSource, GenerateOutput, RolloutEngine, SamplingParams
from slime_rl.core.rollout import RolloutRunner, generate_single_turn
from slime_rl.core.sample import Sample, SampleStatus


class ScriptedEngine(RolloutEngine):
    """Answers prompt [p] with tokens chosen by ``script(prompt_id, call_no)``; ``slow`` prompts
    generate one token per 10 ms until aborted."""

    def __init__(self, script, slow: set[int] = frozenset()):
        self.script, self.slow = script, slow
        self.calls: dict[int, int] = {}
        self.aborted = asyncio.Event()
        self.abort_calls = 0
        self.version = 0

    async def generate(self, input_ids, params, request_id=None):
        prompt_id = input_ids[0]
        n = self.calls[prompt_id] = self.calls.get(prompt_id, 0) + 1
        if prompt_id in self.slow:
            made = []
            while len(made) < params.max_new_tokens and not self.aborted.is_set():
                made.append(7)
                await asyncio.sleep(0.01)
            reason = "abort" if self.aborted.is_set() else "length"
            return GenerateOutput(made, [-0.5] * len(made), reason, self.version)
        await asyncio.sleep(0)
        ids = self.script(prompt_id, n)[: params.max_new_tokens]
        return GenerateOutput(ids, [-0.1] * len(ids), "stop", self.version)

    async def abort(self, request_id=None):
        self.abort_calls += 1
        self.aborted.set()

    async def update_weights(self, named_tensors, *, version, last):
        if last:
            self.version = version

    @property
    def weight_version(self):
        return self.version


class ListSource(DataSource):
    def __init__(self, prompt_ids: list[int], n: int):
        self.prompt_ids, self.n, self.pos = prompt_ids, n, 0

    def get_groups(self, num_groups):
        out = []
        for pid in self.prompt_ids[self.pos : self.pos + num_groups]:
            out.append([Sample(index=pid * 100 + i, group_index=pid, tokens=[pid], label=str(pid))
                        for i in range(self.n)])
        self.pos += len(out)
        return out

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


class ListBuffer(Buffer):
    def __init__(self):
        self.groups: list[list[Sample]] = []

    def add(self, groups):
        self.groups.extend(groups)

    def take(self, num_groups, *, current_version=None, partial=False):
        def unfinished(g):
            return any(s.status in (SampleStatus.PENDING, SampleStatus.ABORTED) for s in g)

        out = [g for g in self.groups if unfinished(g) == partial][:num_groups]
        self.groups = [g for g in self.groups if not any(g is o for o in out)]
        return out

    def __len__(self):
        return len(self.groups)

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


async def digit_reward(sample: Sample) -> float:
    """1 when the response holds the token 1 (decoded as '1')."""
    return float("1" in sample.response)


def make_cfg(**overrides: Any) -> Config:
    base = {
        "data": {"prompt_data": None, "source": "test", "rollout_batch_size": 2, "n_samples_per_prompt": 2},
        "rollout": {"reward": f"{__name__}:digit_reward", "max_response_len": 4},
    }
    for dotted, value in overrides.items():
        section, key = dotted.split("__")
        base.setdefault(section, {})[key] = value
    return Config.model_validate(base)


def decode(ids: list[int]) -> str:
    return " ".join(str(i) for i in ids)


def run(coro):
    return asyncio.run(coro)


def test_rollout_keeps_batch_and_scores():
    engine = ScriptedEngine(lambda pid, n: [1, 2] if n % 2 else [3])
    runner = RolloutRunner(make_cfg(), engine, decode)
    result = run(runner.rollout(ListSource([1, 2, 3], 2), ListBuffer()))
    assert [g[0].group_index for g in result.groups] == [1, 2]
    for group in result.groups:
        assert sorted(s.reward for s in group) == [0.0, 1.0]
        for s in group:
            assert s.status == SampleStatus.COMPLETED
            assert s.loss_mask == [1] * s.response_length
            assert len(s.rollout_log_probs) == s.response_length
    assert result.metrics["rollout/reward_mean"] == 0.5


def test_dynamic_filter_oversampling_aborts_and_returns_leftovers():
    # prompts 1 and 3 give equal rewards (dropped by nonzero_std); 2 and 4 pass; 5 and 6 never finish.
    def script(pid, n):
        if pid in (1, 3):
            return [1]
        return [1] if n % 2 else [3]

    engine = ScriptedEngine(script, slow={5, 6})
    cfg = make_cfg(rollout__over_sampling_batch_size=6, rollout__dynamic_sampling_filter="nonzero_std")
    pending = ListBuffer()
    result = run(RolloutRunner(cfg, engine, decode).rollout(ListSource([1, 2, 3, 4, 5, 6], 2), pending))
    assert sorted(g[0].group_index for g in result.groups) == [2, 4]
    assert result.metrics["rollout/groups_dropped_by_filter"] == 2
    assert engine.abort_calls == 1
    # the two unfinished groups are not lost: back in the pending buffer, reset to their prompt
    assert sorted(g[0].group_index for g in pending.groups) == [5, 6]
    for s in (s for g in pending.groups for s in g):
        assert s.status == SampleStatus.PENDING and s.response_length == 0 and s.tokens == [s.group_index]


def test_partial_rollout_keeps_tokens_and_resumes_with_remaining_budget():
    engine = ScriptedEngine(lambda pid, n: [1] if n % 2 else [3], slow={9})
    cfg = make_cfg(rollout__over_sampling_batch_size=3, rollout__partial_rollout=True,
                   rollout__max_response_len=50)
    pending = ListBuffer()
    run(RolloutRunner(cfg, engine, decode).rollout(ListSource([1, 2, 9], 2), pending))
    (group,) = pending.groups
    assert all(s.status == SampleStatus.ABORTED and s.response_length > 0 for s in group)
    made = group[0].response_length
    # resume: the scripted engine now finishes, with max_new_tokens reduced by what exists
    resumed = ScriptedEngine(lambda pid, n: [1, 1, 1])
    sample = group[0]
    params = SamplingParams(max_new_tokens=50)
    out = run(generate_single_turn(sample, params, resumed))
    assert out.response_length == made + 3
    assert out.tokens[:1] == [9] and out.loss_mask == [1] * (made + 3)


def test_next_rollout_resumes_buffered_groups_before_new_prompts():
    engine = ScriptedEngine(lambda pid, n: [1] if n % 2 else [3], slow={9})
    cfg = make_cfg(rollout__over_sampling_batch_size=3, data__rollout_batch_size=2)
    buffer, source = ListBuffer(), ListSource([1, 2, 9, 4, 5], 2)
    runner = RolloutRunner(cfg, engine, decode)
    run(runner.rollout(source, buffer))
    assert [g[0].group_index for g in buffer.groups] == [9]
    engine.slow, engine.aborted = set(), asyncio.Event()
    second = run(runner.rollout(source, buffer))
    # prompt 9 (aborted last time) comes back first; no prompt is skipped or repeated
    assert sorted(g[0].group_index for g in second.groups) == [4, 9]
    # the surplus group finished after the batch was full: kept, scored, for the next step
    (surplus,) = buffer.groups
    assert surplus[0].group_index == 5 and all(s.reward is not None for s in surplus)


async def two_turn(sample: Sample, params: SamplingParams, engine: RolloutEngine) -> Sample:
    """Turn 1 from the engine, an observation (loss_mask 0), turn 2 from the engine."""
    first = await engine.generate(sample.tokens, params)
    sample.append_response(first.token_ids, first.log_probs, trained=True)
    sample.append_response([42, 43], None, trained=False)
    second = await engine.generate(sample.tokens, params)
    sample.append_response(second.token_ids, second.log_probs, trained=True)
    sample.status = SampleStatus.COMPLETED
    return sample


def test_custom_generate_function_from_config_masks_observations():
    engine = ScriptedEngine(lambda pid, n: [1, 2])
    cfg = make_cfg(rollout__generate_fn=f"{__name__}:two_turn")
    result = run(RolloutRunner(cfg, engine, decode).rollout(ListSource([1, 2], 2), ListBuffer()))
    s = result.groups[0][0]
    assert s.tokens == [1, 1, 2, 42, 43, 1, 2]
    assert s.loss_mask == [1, 1, 0, 0, 1, 1]
    assert s.rollout_log_probs == [-0.1, -0.1, 0.0, 0.0, -0.1, -0.1]


async def broken_generate(sample, params, engine):
    raise RuntimeError("tool server down")


def test_failing_generate_function_fails_only_its_group():
    cfg = make_cfg(rollout__generate_fn=f"{__name__}:broken_generate")
    result = run(RolloutRunner(cfg, ScriptedEngine(lambda p, n: [1]), decode).rollout(ListSource([1], 2), ListBuffer()))
    assert result.groups == [] and result.exhausted
    assert result.metrics["rollout/groups_dropped_failed"] == 1


def test_eval_reports_mean_reward_and_pass_at_k():
    engine = ScriptedEngine(lambda pid, n: [1] if pid == 1 else [3])
    cfg = make_cfg(eval__n_samples_per_prompt=2)
    runner = RolloutRunner(cfg, engine, decode)
    sets = {"toy": ListSource([1, 2], 2).get_groups(2)}
    metrics = run(runner.evaluate(sets))
    assert metrics["eval/toy/reward_mean"] == 0.5
    assert metrics["eval/toy/pass@2"] == 0.5


@pytest.mark.parametrize("failure,expected", [("zero", 1), ("drop", 0)])
def test_reward_failure_policy(failure, expected):
    cfg = make_cfg(rollout__reward=f"{__name__}:exploding_reward", rollout__on_reward_failure=failure,
                   data__rollout_batch_size=1)
    result = run(RolloutRunner(cfg, ScriptedEngine(lambda p, n: [1]), decode).rollout(ListSource([1, 2], 2),
                                                                                    ListBuffer()))
    assert len(result.groups) == expected
    if expected:
        assert all(s.status == SampleStatus.FAILED and "boom" in s.metadata["error"] for s in result.groups[0])


async def exploding_reward(sample: Sample) -> float:
    raise ValueError("boom")
