"""Rollout orchestration over a scripted engine: over-sampling, filtering, abort, partial rollout,
custom generate functions and eval. The engine here is a test double of the RolloutEngine
contract; the real engines have their own tests and the end-to-end tests use them."""

from __future__ import annotations

import asyncio
import logging
import textwrap
import time
from typing import Any

import pytest

from slime_rl.core.config import Config
from slime_rl.core.contracts import Buffer, DataSource, GenerateOutput, RolloutEngine, SamplingParams
from slime_rl.core.run.rollout import RolloutRunner, generate_single_turn, sampling_params
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
        # reward_workers=0: rewards run in this process, so groups finish in a set order (workers: test_workers.py)
        "rollout": {"reward": f"{__name__}:digit_reward", "max_response_len": 4, "reward_workers": 0},
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
    assert metrics["eval/toy/prompts"] == 2  # what the accuracy is read against


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


async def outsized_reward(sample: Sample) -> float:
    """Finite, but beyond what the step's statistics hold: 1e308 overflowed the mean metric (a crash),
    1e160 a group's variance (its advantages silently all 0). Group 1, and group 2's first sample."""
    return {100: 1e308, 101: 1e308, 200: 1e160}.get(sample.index, 0.0)


def test_an_outsized_finite_reward_fails_its_sample_and_the_run_goes_on():
    cfg = make_cfg(rollout__reward=f"{__name__}:outsized_reward", data__rollout_batch_size=3)
    result = run(RolloutRunner(cfg, ScriptedEngine(lambda p, n: [1]), decode).rollout(ListSource([1, 2, 3], 2),
                                                                                    ListBuffer()))
    assert result.failure is None and [g[0].group_index for g in result.groups] == [1, 2, 3]
    samples = [s for g in result.groups for s in g]
    assert [s.status == SampleStatus.FAILED for s in samples] == [True, True, True, False, False, False]
    assert samples[0].metadata["error"] == (
        f"reward '{__name__}:outsized_reward' returned an unusable result: reward is 1e+308, beyond the bound "
        "|reward| <= 1e+30 that keeps advantages and metrics finite; scale the reward down")
    assert "reward is 1e+160, beyond the bound" in samples[2].metadata["error"]
    assert [s.reward for s in samples] == [0.0] * 6  # on_reward_failure=zero
    assert result.metrics["rollout/samples_failed"] == 3 and result.metrics["rollout/reward_mean"] == 0.0


# ---------------------------------------------------------------- failures in bulk, user filters, a blocked loop


@pytest.mark.parametrize("policy", ["zero", "drop"])
def test_a_step_fails_when_more_than_max_failed_fraction_of_its_samples_failed(policy):
    cfg = make_cfg(rollout__reward=f"{__name__}:exploding_reward", rollout__on_reward_failure=policy,
                   rollout__max_failed_fraction=0.5)
    source = ListSource(list(range(1, 21)), 2)
    result = run(RolloutRunner(cfg, ScriptedEngine(lambda p, n: [1]), decode).rollout(source, ListBuffer()))
    assert result.failure == (f"4 of 4 samples failed, more than rollout.max_failed_fraction=0.5; the first: "
                              f"reward '{__name__}:exploding_reward' raised ValueError: boom")
    assert source.pos == 2  # it stopped after one round of groups; it did not run through the data
    assert result.metrics["rollout/step_failed"] == 1.0 and result.metrics["rollout/samples_failed"] == 4


async def fails_on_prompt_1(sample: Sample) -> float:
    if sample.group_index == 1:
        raise ValueError("boom")
    return 1.0


def test_failures_up_to_max_failed_fraction_do_not_fail_the_step_and_are_logged_with_their_reason(caplog):
    cfg = make_cfg(rollout__reward=f"{__name__}:fails_on_prompt_1", rollout__max_failed_fraction=0.5)
    with caplog.at_level(logging.WARNING, logger="slime_rl.core.run.rollout"):
        result = run(RolloutRunner(cfg, ScriptedEngine(lambda p, n: [1]), decode).rollout(ListSource([1, 2], 2),
                                                                                        ListBuffer()))
    assert result.failure is None and len(result.groups) == 2
    assert result.metrics["rollout/samples_failed"] == 2 and result.metrics["rollout/step_failed"] == 0.0
    assert [r.getMessage() for r in caplog.records if r.name == "slime_rl.core.run.rollout"] == [
        "2 of 4 samples failed, within rollout.max_failed_fraction=0.5 (their groups were dropped and refilled, "
        f"or scored 0 under rollout.on_reward_failure=zero): 2 x reward '{__name__}:fails_on_prompt_1' raised "
        "ValueError: boom"]


USER_FILTERS = textwrap.dedent('''
    import time

    def keep_odd(group):
        return group[0].group_index % 2 == 1

    def raises(group):
        raise KeyError("label")

    def hangs(group):
        if group[0].group_index == 1:
            time.sleep(3600)
        return True

    def says_maybe(group):
        return "maybe"
''')


@pytest.fixture
def user_filters(tmp_path, monkeypatch):
    from slime_rl.core.infra.workers import close_user_code_pools

    (tmp_path / "user_filters_for_test.py").write_text(USER_FILTERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    close_user_code_pools()


@pytest.mark.parametrize("spec, reason", [
    ("keep_odd", None),
    ("raises", "dynamic_sampling_filter 'user_filters_for_test:raises' raised KeyError: 'label'"),
    ("hangs", "dynamic_sampling_filter 'user_filters_for_test:hangs' timed out after 3 s"),
    ("says_maybe", "dynamic_sampling_filter 'user_filters_for_test:says_maybe' returned str 'maybe'; "
                   "a filter returns True or False"),
])
def test_a_user_filter_runs_in_a_worker_and_its_failures_fail_its_group(user_filters, spec, reason):
    # a short timeout only where a filter hangs: on a loaded 2-core CI machine a 1 s bound once timed out keep_odd
    timeout = 3.0 if spec == "hangs" else 20.0
    cfg = make_cfg(rollout__dynamic_sampling_filter=f"user_filters_for_test:{spec}", rollout__reward_timeout=timeout,
                   rollout__reward="exact_match", rollout__reward_workers=2, rollout__max_failed_fraction=0.0,
                   data__rollout_batch_size=1, rollout__over_sampling_batch_size=2)
    engine = ScriptedEngine(lambda p, n: [1])
    start = time.monotonic()
    result = run(RolloutRunner(cfg, engine, decode).rollout(ListSource([1, 2, 3, 4], 2), ListBuffer()))
    assert time.monotonic() - start < 30
    if reason is None:
        assert [g[0].group_index for g in result.groups] == [1] and result.failure is None
        return
    assert result.failure is not None and result.failure.endswith(f"the first: {reason}")
    assert result.metrics["rollout/groups_dropped_failed"] >= 1 and result.metrics["rollout/samples_failed"] >= 2
    # only group 1 hangs: the other passes once its worker is killed (and is kept, though the step failed)
    assert [g[0].group_index for g in result.groups] == ([2] if spec == "hangs" else [])


async def blocking_generate(sample, params, engine):
    time.sleep(1.5)  # a blocking call in async code: the whole event loop stops
    return await generate_single_turn(sample, params, engine)


def test_the_watchdog_names_the_function_that_blocks_the_event_loop(caplog):
    cfg = make_cfg(rollout__generate_fn=f"{__name__}:blocking_generate", rollout__loop_block_warn_s=0.5,
                   data__rollout_batch_size=1, data__n_samples_per_prompt=1)
    runner = RolloutRunner(cfg, ScriptedEngine(lambda p, n: [1]), decode)
    result = run(runner.rollout(ListSource([1], 1), ListBuffer()))
    assert len(result.groups) == 1  # it only reports; the step goes on
    report = runner.watchdog.reports[0]
    assert report.startswith("the rollout's event loop has been blocked for ")
    assert f"in async function {__name__}.blocking_generate, at {__file__}:" in report
    assert any("blocking_generate" in r.getMessage() for r in caplog.records)


def test_engine_busy_clock_counts_overlapping_generation_once():
    """Two slow prompts generate at once for ~0.2 s, then the engine idles 0.2 s: busy ~0.2 s, not 0.4."""
    engine = ScriptedEngine(lambda pid, n: [1], slow={1, 2})
    runner = RolloutRunner(make_cfg(rollout__max_response_len=20), engine, decode)

    async def scenario() -> tuple[float, float]:
        result = await runner.rollout(ListSource([1, 2], 1), ListBuffer())
        assert len(result.groups) == 2 and runner.engine_busy.running == 0
        busy_after_rollout = runner.engine_busy.seconds()
        await asyncio.sleep(0.2)
        return busy_after_rollout, runner.engine_busy.seconds()

    started = time.perf_counter()
    busy, busy_later = run(scenario())
    elapsed = time.perf_counter() - started
    assert busy == busy_later  # idle time does not count
    assert 0.15 < busy <= elapsed - 0.2  # ~20 tokens x 10 ms, the two prompts at once counted once


def test_ignore_eos_reaches_the_engine_for_training_but_not_for_evaluation():
    """rollout.ignore_eos: long-context runs generate to max_response_len; held-out scores keep eos."""
    seen: list[SamplingParams] = []

    class Recording(ScriptedEngine):
        async def generate(self, input_ids, params, request_id=None):
            seen.append(params)
            return await super().generate(input_ids, params, request_id)

    runner = RolloutRunner(make_cfg(rollout__ignore_eos=True), Recording(lambda pid, n: [1, 2]), decode)
    run(runner.rollout(ListSource([1, 2], 2), ListBuffer()))
    assert seen and all(p.ignore_eos for p in seen)
    assert not sampling_params(make_cfg(rollout__ignore_eos=True), evaluation=True).ignore_eos
    assert not sampling_params(make_cfg()).ignore_eos
