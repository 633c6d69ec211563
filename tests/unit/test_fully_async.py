"""cluster.async_mode=fully at unit level: the mode key, per-token versions and the staleness policies,
the producer / next_batch hand-off, the abort fallback and the JSON in-flight state (no Ray, no model)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import torch

from slime_rl.core.algorithms import staleness
from slime_rl.core.algorithms.filters import stalest_first
from slime_rl.core.algorithms.losses import LossBatch, compute_loss
from slime_rl.core.batch import RolloutBatch
from slime_rl.core.config import Config, ConfigError, load_config
from slime_rl.core.contracts import DataSource, GenerateOutput, RolloutEngine
from slime_rl.core.run.fully_async import FullyAsyncRollout
from slime_rl.core.run.rollout import RolloutRunner, generate_single_turn
from slime_rl.core.sample import Sample, SampleStatus

# ---------------------------------------------------------------- the mode key


def test_the_old_async_key_is_refused_naming_the_new_one(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"input": "1+1", "label": "2"}\n')
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"data.prompt_data={prompts}", "cluster.async=true", "cluster.colocate=false"])
    assert err.value.field == "cluster.async" and "cluster.async_mode" in str(err.value)
    # YAML reads a bare `off` as false: it is the mode off
    assert load_config(None, [f"data.prompt_data={prompts}", "cluster.async_mode=off"]).cluster.async_mode == "off"
    cfg = load_config(None, [f"data.prompt_data={prompts}", "cluster.async_mode=fully", "cluster.device=cpu"])
    assert cfg.cluster.async_mode == "fully" and cfg.cluster.colocate  # CPU: separate processes anyway
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"data.prompt_data={prompts}", "cluster.async_mode=fully", "cluster.device=cuda"])
    assert err.value.field == "cluster.async_mode" and "colocate=false" in str(err.value)


# ---------------------------------------------------------------- per-token versions and the policies


def mixed_sample(versions: list[int], index: int = 0) -> Sample:
    """A sample whose response was generated across weight updates: one token per version given."""
    s = Sample(index=index, group_index=index, tokens=[5, 6], reward=1.0, weight_version=versions[0])
    s.append_response([7] * len(versions), [-0.5] * len(versions), trained=True, versions=versions)
    return s


def test_a_response_spanning_an_update_carries_both_versions_into_the_batch():
    class SwitchingEngine(ScriptedEngine):
        async def generate(self, input_ids, params, request_id=None):
            return GenerateOutput([7, 8, 9, 10], [-1.0] * 4, "length", 4, token_versions=[3, 3, 4, 4])

    sample = Sample(tokens=[1, 2])
    asyncio.run(generate_single_turn(sample, make_cfg_params(), SwitchingEngine()))
    assert sample.token_versions == [3, 3, 4, 4] and sample.weight_version == 3  # the oldest token's
    sample.reward = 1.0
    batch = RolloutBatch.from_samples([sample])
    assert batch.token_versions.tolist() == [3, 3, 4, 4]
    assert batch.select([0]).token_versions.tolist() == [3, 3, 4, 4]


@pytest.mark.parametrize("policy", ["drop", "mask", "downweight"])
def test_staleness_policies_per_token(policy):
    sample = mixed_sample([3, 3, 4, 4])
    current, eta = 5, 1  # the version-3 tokens are 2 behind: stale; the version-4 ones are fresh
    assert not staleness.eligible([sample], current, eta) and staleness.eligible([sample], 4, eta)
    weights = staleness.apply_policy([sample], current, eta, policy)
    if policy == "drop":
        assert weights is None and sample.loss_mask == [1, 1, 1, 1]  # the caller leaves the group out
    elif policy == "mask":
        assert weights is None and sample.loss_mask == [0, 0, 1, 1]
        assert RolloutBatch.from_samples([sample]).step_tokens == [2.0]
    else:
        assert weights.tolist() == pytest.approx([2 / 3, 2 / 3, 1.0, 1.0])
    m = staleness.metrics([sample], current)
    assert m["staleness/max"] == 2 and m["staleness/mixed_version_frac"] == 1.0 and m["staleness/frac_1"] == 0.5


def test_downweighted_tokens_scale_the_loss_and_tis_uses_each_tokens_own_log_prob():
    """TIS divides by the engine's per-token log-prob, which the version that sampled each token produced."""
    algo = Config().algorithm.model_copy(update={"use_tis": True, "tis_clip": 10.0})
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    rollout = torch.tensor([[-1.5, -0.5]])  # token 0 from an older version that liked it less
    full = LossBatch(log_probs=logp, old_log_probs=logp.detach(), advantages=torch.ones(1, 2),
                     loss_mask=torch.ones(1, 2), rollout_log_probs=rollout)
    _, metrics = compute_loss(algo, full, eps_clip_high=0.2, num_tokens=2, num_seqs=1)
    assert float(metrics["tis_weight_mean"]) == pytest.approx((torch.exp(torch.tensor(0.5)) + torch.exp(
        torch.tensor(-0.5))).item() / 2)
    weighted = LossBatch(**{**full.__dict__, "loss_mask": torch.tensor([[0.0, 1.0]])})
    loss_full, _ = compute_loss(algo, full, eps_clip_high=0.2, num_tokens=2, num_seqs=1)
    loss_half, _ = compute_loss(algo, weighted, eps_clip_high=0.2, num_tokens=2, num_seqs=1)
    assert loss_half.item() == pytest.approx(-torch.exp(torch.tensor(-0.5)).item() / 2)
    assert loss_full.item() != pytest.approx(loss_half.item())


def test_stalest_first_hands_out_the_oldest_tokens_first():
    groups = [[mixed_sample([4, 4], 0)], [mixed_sample([2, 5], 1)], [mixed_sample([3], 2)]]
    assert stalest_first(groups, 2) == [1, 2]


# ---------------------------------------------------------------- the producer and next_batch


class ScriptedEngine(RolloutEngine):
    """Prompt [p] -> tokens [1, p]; ``pause`` says whether it can pause (else the update aborts)."""

    def __init__(self, pause: bool = True, delay: float = 0.0):
        self.version, self.pause, self.delay = 0, pause, delay
        self.aborted = False
        self.calls = 0

    async def generate(self, input_ids, params, request_id=None):
        self.calls += 1
        made, versions = [], []
        already = len(input_ids) - 1  # a partial rollout continues where it stopped
        for token in (1, input_ids[0])[already:][: params.max_new_tokens]:
            await asyncio.sleep(self.delay)
            if self.aborted:
                return GenerateOutput(made, [-0.1] * len(made), "abort", self.version, token_versions=versions)
            made.append(token)
            versions.append(self.version)
        return GenerateOutput(made, [-0.1] * len(made), "stop", self.version, token_versions=versions)

    async def abort(self, request_id=None):
        self.aborted = True

    async def pause_generation(self) -> bool:
        return self.pause

    async def update_weights(self, named_tensors, *, version, last):
        self.version = version
        self.aborted = False

    @property
    def weight_version(self):
        return self.version


class ListSource(DataSource):
    def __init__(self, num_prompts: int, n: int = 2):
        self.num_prompts, self.n, self.pos = num_prompts, n, 0

    def get_groups(self, num_groups):
        out = [[Sample(index=p * 10 + i, group_index=p, tokens=[p], label=str(p)) for i in range(self.n)]
               for p in range(self.pos, min(self.pos + num_groups, self.num_prompts))]
        self.pos += len(out)
        return out

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


async def even_reward(sample: Sample) -> float:
    """1 on even prompts, 0 on odd; with nonzero_std-like filters every group is constant."""
    return float(sample.tokens[0] % 2 == 0)


def make_cfg(**rollout: Any) -> Config:
    return Config.model_validate({
        "data": {"prompt_data": None, "source": "test", "rollout_batch_size": 2, "n_samples_per_prompt": 2},
        "rollout": {"reward": f"{__name__}:even_reward", "max_response_len": 4, "reward_workers": 0, **rollout},
        "cluster": {"async_mode": "fully"},
    })


def make_cfg_params():
    from slime_rl.core.run.rollout import sampling_params

    return sampling_params(make_cfg())


def make_rollout(cfg: Config, engine: ScriptedEngine, source: ListSource) -> FullyAsyncRollout:
    runner = RolloutRunner(cfg, engine, lambda ids: " ".join(map(str, ids)))
    return FullyAsyncRollout(cfg, runner, source, lambda: engine.version)


def accounted(ledger) -> list[int]:
    return sorted(ledger.trained + ledger.filtered + ledger.failed + ledger.dropped_stale)


def test_every_group_is_trained_or_recorded_exactly_once():
    cfg = make_cfg(dynamic_sampling_filter=f"{__name__}:keep_even")
    engine, source = ScriptedEngine(), ListSource(9)
    rollout = make_rollout(cfg, engine, source)

    async def main():
        batches = []
        while True:
            batch = await rollout.next_batch(engine.version)
            batches.append([g[0].group_index for g in batch.groups])
            await engine.update_weights([], version=engine.version + 1, last=True)
            if batch.exhausted or not batch.groups:
                break
        await rollout.stop()
        return batches

    batches = asyncio.run(main())
    assert [p for b in batches for p in b] == rollout.ledger.trained
    assert sorted(rollout.ledger.trained) == [0, 2, 4, 6, 8] and rollout.ledger.filtered == [1, 3, 5, 7]
    assert accounted(rollout.ledger) == list(range(9))


def keep_even(group: list[Sample]) -> bool:
    return group[0].tokens[0] % 2 == 0


def test_stale_groups_are_dropped_and_recorded():
    cfg = make_cfg(max_staleness=0)
    engine, source = ScriptedEngine(), ListSource(4)
    rollout = make_rollout(cfg, engine, source)

    async def main():  # the engine stays at version 0 while the trainer is at 1: every group is stale
        return await rollout.next_batch(current_version=1)

    batch = asyncio.run(main())
    assert batch.groups == [] and sorted(rollout.ledger.dropped_stale) == [0, 1, 2, 3] and batch.exhausted


def test_an_engine_that_cannot_pause_is_aborted_and_its_requests_resume_with_their_tokens():
    cfg = make_cfg()
    engine, source = ScriptedEngine(pause=False, delay=0.01), ListSource(2)
    rollout = make_rollout(cfg, engine, source)

    async def main():
        rollout.start()
        await asyncio.sleep(0.015)  # first token of each request made
        await engine.abort()  # what the rollout worker does for a sync to an engine that cannot pause
        await asyncio.sleep(0.02)
        await engine.update_weights([], version=1, last=True)
        return await rollout.next_batch(current_version=1)

    batch = asyncio.run(main())
    samples = [s for g in batch.groups for s in g]
    assert len(samples) == 4 and all(s.status == SampleStatus.COMPLETED for s in samples)
    assert all(s.response_tokens == [1, s.tokens[0]] for s in samples)  # one response, continued
    assert all(s.token_versions == [0, 1] for s in samples)
    assert rollout.counts["requeued_aborted"] >= 1


def test_the_in_flight_state_is_json_and_a_resume_skips_and_repeats_nothing():
    cfg = make_cfg()
    engine, source = ScriptedEngine(delay=0.005), ListSource(6)
    rollout = make_rollout(cfg, engine, source)

    async def first_life():
        first = await rollout.next_batch(0)
        await asyncio.sleep(0.004)  # more groups mid-generation
        state = {"source": source.state_dict(), "fully": rollout.state_dict()}
        await rollout.stop()
        return first, json.loads(json.dumps(state))  # JSON and back: nothing else is in it

    first, state = asyncio.run(first_life())
    assert state["fully"]["in_flight"], "the test means to checkpoint with groups in flight"
    trained_before = [g[0].group_index for g in first.groups]

    engine2, source2 = ScriptedEngine(), ListSource(6)
    engine2.version = 1  # a resume syncs the checkpoint's weights (one step: version 1) first
    source2.load_state_dict(state["source"])
    resumed = make_rollout(cfg, engine2, source2)
    resumed.load_state_dict(state["fully"])

    async def second_life():
        out = []
        while True:
            batch = await resumed.next_batch(engine2.version)
            out += [g[0].group_index for g in batch.groups]
            await engine2.update_weights([], version=engine2.version + 1, last=True)  # the step's sync
            if batch.exhausted or not batch.groups:
                return out

    after = asyncio.run(second_life())
    assert sorted(trained_before + after) == list(range(6))
    assert resumed.ledger.trained == trained_before + after


async def broken_filter(group: list[Sample]) -> bool:
    raise ValueError("not a filter")


def test_a_failing_producer_surfaces_in_next_batch_instead_of_hanging():
    cfg = make_cfg()
    engine, source = ScriptedEngine(), ListSource(4)
    rollout = make_rollout(cfg, engine, source)
    rollout.runner._filter = broken_filter  # a bug past the per-sample error handling

    with pytest.raises(RuntimeError, match="producer failed"):
        asyncio.run(asyncio.wait_for(rollout.next_batch(0), 10))


def test_generation_runs_at_most_eta_versions_ahead_of_the_trainer():
    """AReaL's bound: with an engine far faster than the trainer, nothing is generated only to turn stale."""
    cfg = make_cfg(max_staleness=1)
    engine, source = ScriptedEngine(), ListSource(40)
    rollout = make_rollout(cfg, engine, source)

    async def main():
        for _ in range(5):
            batch = await rollout.next_batch(engine.version)
            assert len(batch.groups) == 2
            await asyncio.sleep(0.05)  # "training": the producer has all the time it wants
            assert len(rollout.ledger.trained) + len(rollout.ready) + len(rollout.in_flight) <= (
                engine.version + 2) * 2
            await engine.update_weights([], version=engine.version + 1, last=True)
        await rollout.stop()

    asyncio.run(main())
    assert rollout.ledger.dropped_stale == [] and source.pos <= (5 + 2) * 2
