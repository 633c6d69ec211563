"""Rollout orchestration: prompt groups in, scored and filtered sample groups out.

One rollout step, as slime does it: submit ``over_sampling_batch_size`` prompt
groups at once, score each group as soon as all its samples are back, keep the
groups the dynamic-sampling filter accepts, refill while too few passed, and once
``rollout_batch_size`` groups are kept abort the leftovers. Aborted groups are
never lost: they go back to the pending buffer, keeping their tokens when
``partial_rollout`` is on and reset to their prompt otherwise.

A step fails when more than ``rollout.max_failed_fraction`` of the samples it finished
failed (reward or filter raised or timed out, generate function raised): the rollout
stops at the end of that round of groups and says why in ``ScoredGroups.failure``;
the loop then does not train on it (loop.py). A user's filter (``module:attr``) runs
in the reward workers (rewards/__init__.py says why), under ``rollout.reward_timeout``.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from slime_rl.core.algorithms.filters import DYNAMIC_SAMPLING_FILTERS
from slime_rl.core.config import Config
from slime_rl.core.config.secrets import redact
from slime_rl.core.contracts import Buffer, DataSource, GenerateFn, RolloutEngine, SamplingParams
from slime_rl.core.infra.plugins import PluginError, load_function
from slime_rl.core.infra.watchdog import LoopWatchdog
from slime_rl.core.infra.workers import UserCodeError, UserCodeLoadError, is_user_code, user_code_pool
from slime_rl.core.rewards import reward_workers, score_samples
from slime_rl.core.run.metrics import BusyClock
from slime_rl.core.sample import Sample, SampleStatus

logger = logging.getLogger(__name__)

Decode = Callable[[list[int]], str]
Group = list[Sample]

_FINISH_STATUS = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}
_request_ids = itertools.count()


def sampling_params(cfg: Config, *, evaluation: bool = False) -> SamplingParams:
    r = cfg.rollout
    if evaluation:
        return SamplingParams(
            temperature=cfg.eval.temperature, top_p=1.0 if cfg.eval.temperature == 0 else r.top_p, top_k=r.top_k,
            max_new_tokens=cfg.eval.max_response_len or r.max_response_len,
            stop=list(r.stop), stop_token_ids=list(r.stop_token_ids),
        )
    return SamplingParams(
        temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_response_len,
        stop=list(r.stop), stop_token_ids=list(r.stop_token_ids), ignore_eos=r.ignore_eos,
        return_routed_experts=cfg.algorithm.routing_replay == "rollout",
    )


async def generate_single_turn(sample: Sample, params: SamplingParams, engine: RolloutEngine) -> Sample:
    """The default generate function: one engine call, the sampled ids appended to the sample.

    A partially generated sample (partial rollout) continues where it stopped,
    with ``max_new_tokens`` reduced by what it already has."""
    remaining = params.max_new_tokens - sample.response_length
    if remaining <= 0:
        sample.status = SampleStatus.TRUNCATED
        return sample
    call_params = SamplingParams(**{**params.__dict__, "max_new_tokens": remaining})
    request_id = f"s{sample.index}-{next(_request_ids)}"
    images = (sample.multimodal_inputs or {}).get("images")  # vision-language samples (docs/vlm.md)
    out = await engine.generate(sample.tokens, call_params, request_id=request_id,
                                **({"images": list(images)} if images else {}))
    if out.cached_tokens is not None:  # the engine reports its prefix cache: rollout/prefix_cache_hit_rate
        sample.metadata["prompt_tokens"] = sample.metadata.get("prompt_tokens", 0) + len(sample.tokens)
        sample.metadata["cached_tokens"] = sample.metadata.get("cached_tokens", 0) + out.cached_tokens
    versions = out.token_versions if out.token_versions is not None else [out.weight_version] * len(out.token_ids)
    if sample.response_length == 0:
        sample.weight_version = min(versions, default=out.weight_version)  # the oldest token's
    sample.append_response(out.token_ids, out.log_probs, trained=True, versions=versions)
    if out.routed_experts is not None:  # the whole sequence's (a continuation's input holds the earlier part)
        sample.rollout_routed_experts = out.routed_experts
    sample.status = _FINISH_STATUS[out.finish_reason]
    return sample


BUILTIN_GENERATE_FNS = ("multi_turn", "gateway", "environment")  # built by load_generate_fn: they need the config and tokenizer


def load_generate_fn(cfg: Config, tokenizer: Any = None) -> GenerateFn:
    """``rollout.generate_fn``: single turn when unset, the built-in agent loop, or a user's ``module:attr``."""
    spec = cfg.rollout.generate_fn
    if not spec:
        return generate_single_turn
    if spec in ("multi_turn", "environment"):  # environment: an Environment drives the same loop
        from slime_rl.core.agent import MultiTurnGenerate

        if tokenizer is None:
            raise PluginError(f"rollout.generate_fn: {spec} renders tool results with the model's tokenizer,"
                              " and this rollout has none")
        return MultiTurnGenerate.from_config(cfg, tokenizer)
    if spec == "gateway":  # the user's own agent against the run's OpenAI-compatible gateway
        from slime_rl.core.gateway import GatewayGenerate

        if tokenizer is None:
            raise PluginError("rollout.generate_fn: gateway renders chat requests with the model's tokenizer,"
                              " and this rollout has none")
        return GatewayGenerate.from_config(cfg, tokenizer)
    return load_function(spec, {}, what="rollout.generate_fn")


@dataclass
class ScoredGroups:
    """A rollout step's samples, scored and filtered: what `RolloutRunner` (and the fully async
    producer) hands the rollout worker, which turns them into `RolloutBatch` shards. Per-token data:
    it stays in the rollout process."""

    groups: list[Group]  # kept groups, scored, at most rollout_batch_size
    metrics: dict[str, float] = field(default_factory=dict)
    returned: int = 0  # groups put back in the pending buffer (aborted leftovers)
    exhausted: bool = False  # the data ran out before enough groups passed
    failure: str | None = None  # why the step failed (too many failed samples); None when it did not


@dataclass
class FailedSamples:
    """A step's failed samples by reason: the step's failure names the first, and a step that goes on with
    failures under ``rollout.max_failed_fraction`` logs them all, so a user learns why without a stopped run."""

    seen: int = 0
    reasons: Counter[str] = field(default_factory=Counter)

    @property
    def failed(self) -> int:
        return sum(self.reasons.values())

    def add(self, group: Group) -> None:
        self.seen += len(group)
        self.reasons.update(s.metadata.get("error", "no reason recorded") for s in group
                            if s.status == SampleStatus.FAILED)

    def over(self, limit: float) -> str | None:
        """Why the step fails: more than ``limit`` of the samples seen failed; None while not."""
        if not self.seen or self.failed / self.seen <= limit:
            return None
        first = next(iter(self.reasons))
        return f"{self.failed} of {self.seen} samples failed, more than rollout.max_failed_fraction={limit:g}; " \
               f"the first: {first}"

    def log_tolerated(self, limit: float) -> None:
        if self.failed and self.over(limit) is None:
            logger.warning("%d of %d samples failed, within rollout.max_failed_fraction=%g (their groups were "
                           "dropped and refilled, or scored 0 under rollout.on_reward_failure=zero): %s",
                           self.failed, self.seen, limit,
                           "; ".join(f"{n} x {reason}" for reason, n in self.reasons.most_common()))


class RolloutRunner:
    """Generates, scores and filters groups through any `RolloutEngine`."""

    def __init__(self, cfg: Config, engine: RolloutEngine, decode: Decode, tokenizer: Any = None):
        self.cfg = cfg
        self.engine = engine
        self.decode = decode
        self.generate_fn: GenerateFn = load_generate_fn(cfg, tokenizer)
        spec = cfg.rollout.dynamic_sampling_filter
        in_worker = bool(spec) and is_user_code(spec) and reward_workers(cfg.rollout) > 0
        self.keep_group = (None if not spec or in_worker  # a user's filter runs in a worker process
                           else load_function(spec, DYNAMIC_SAMPLING_FILTERS, what="rollout.dynamic_sampling_filter"))
        self.watchdog: LoopWatchdog | None = None
        self.semaphore = asyncio.Semaphore(cfg.rollout.max_concurrency)
        self.enough = False  # set once a rollout has its groups: queued requests then never start
        self.engine_busy = BusyClock()  # while any sample generates: the engine's busy time

    async def _generate_group(self, group: Group, params: SamplingParams) -> Group:
        async def one(sample: Sample) -> list[Sample]:
            async with self.semaphore:
                if sample.status not in (SampleStatus.PENDING, SampleStatus.ABORTED):
                    return [sample]  # finished before an earlier abort; keep it as is
                if self.enough:
                    sample.status = SampleStatus.ABORTED
                    return [sample]
                try:
                    with self.engine_busy.busy():
                        out = await self.generate_fn(sample, params, self.engine)
                except asyncio.CancelledError:
                    raise
                except Exception as err:  # a user's generate function failing loses only its sample
                    sample.status = SampleStatus.FAILED
                    sample.metadata["error"] = redact(f"generate: {type(err).__name__}: {err}")
                    return [sample]
            return out if isinstance(out, list) else [out]

        results = await asyncio.gather(*(one(s) for s in group))
        samples = [s for part in results for s in part]
        for s in samples:
            s.response = self.decode(s.response_tokens)
        if all(s.status != SampleStatus.ABORTED for s in samples):
            await score_samples([s for s in samples if s.status != SampleStatus.FAILED], self.cfg.rollout)
        return samples

    def _watch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self.watchdog is None or self.watchdog.loop is not loop:
            if self.watchdog is not None:
                self.watchdog.stop()
            self.watchdog = LoopWatchdog(loop, self.cfg.rollout.loop_block_warn_s, what="rollout's event loop")

    async def _filter(self, group: Group) -> bool | None:
        """The dynamic-sampling filter's verdict; None when it failed: then the group's samples are
        FAILED (they count against ``max_failed_fraction``) and the group is dropped."""
        r = self.cfg.rollout
        spec = r.dynamic_sampling_filter
        if spec is None:
            return True
        if self.keep_group is not None:
            return bool(self.keep_group(group))
        try:
            keep = await user_code_pool(reward_workers(r)).acall(spec, (group,), r.reward_timeout)
            if not isinstance(keep, bool) and type(keep).__name__ != "bool_":  # numpy's bool is fine
                raise UserCodeError(f"returned {type(keep).__name__} {keep!r:.80}; a filter returns True or False")
            return bool(keep)
        except UserCodeLoadError as err:
            raise PluginError(f"rollout.dynamic_sampling_filter: {spec!r} does not load: {err}") from None
        except TimeoutError:
            reason = f"dynamic_sampling_filter {spec!r} timed out after {r.reward_timeout:g} s"
        except UserCodeError as err:
            reason = f"dynamic_sampling_filter {spec!r} {err}"
        for sample in group:
            sample.status = SampleStatus.FAILED
            sample.metadata["error"] = reason
        return None

    async def run_step(self, data_source: DataSource, buffer: Buffer, *, current_version: int) -> ScoredGroups:
        """One rollout step, the only place a step takes from the buffer: generate and keep groups
        (`rollout`), store them durably, and take the step's training groups (oldest first, with
        the buffer's staleness bound against ``current_version``) into ``groups``. A failed step's
        groups are handed out for the record, never buffered: nothing trains on them."""
        result = await self.rollout(data_source, buffer)
        if result.failure is not None:
            return result
        if result.groups:
            buffer.add(result.groups)
        result.groups = buffer.take(self.cfg.data.rollout_batch_size, current_version=current_version)
        return result

    async def rollout(self, data_source: DataSource, buffer: Buffer) -> ScoredGroups:
        """One training rollout: ``rollout_batch_size`` kept groups (fewer only when the data ran out).

        Groups still needing generation come from ``buffer`` first (``take(partial=True)``),
        then from ``data_source``. Aborted and surplus groups go back to ``buffer``."""
        cfg = self.cfg
        self._watch_loop()
        want, batch = cfg.data.rollout_batch_size, cfg.over_sampling_batch_size
        params = sampling_params(cfg)
        kept: list[Group] = []
        seen = dropped_filter = dropped_failed = returned = 0
        failed_samples = FailedSamples()
        failure: str | None = None
        exhausted = False
        start = time.perf_counter()
        self.enough = False
        while len(kept) < want and not exhausted:
            prompts = buffer.take(batch, partial=True)
            if len(prompts) < batch:
                prompts += data_source.get_groups(batch - len(prompts))
            exhausted = len(prompts) < batch
            if not prompts:
                break
            tasks = [asyncio.ensure_future(self._generate_group(g, params)) for g in prompts]
            leftovers: list[Group] = []
            for next_done in asyncio.as_completed(tasks):
                group = await next_done
                if any(s.status in (SampleStatus.PENDING, SampleStatus.ABORTED) for s in group):
                    leftovers.append(group)  # cut short by the abort below: resumed on a later step
                    continue
                seen += 1
                # None: a reward failed under on_reward_failure="drop" (not filtered, dropped), or the filter failed
                verdict = await self._filter(group) if all(s.reward is not None for s in group) else None
                failed_samples.add(group)
                if verdict is None:
                    dropped_failed += 1
                elif not verdict:
                    dropped_filter += 1
                elif len(kept) < want:
                    kept.append(group)
                    if len(kept) == want:
                        self.enough = True
                        await self.engine.abort(None)
                else:
                    leftovers.append(group)  # finished after we had enough: trained on a later step
            if leftovers:
                buffer.add([self._prepare_leftover(g) for g in leftovers])
                returned += len(leftovers)
            failure = failed_samples.over(cfg.rollout.max_failed_fraction)
            if failure is not None:
                break
        failed_samples.log_tolerated(cfg.rollout.max_failed_fraction)
        elapsed = time.perf_counter() - start
        kept.sort(key=lambda g: g[0].group_index)  # in data order, not finishing order: timing does not reorder a batch
        metrics = self._metrics(kept, elapsed)
        metrics.update({
            "rollout/groups_seen": seen, "rollout/groups_dropped_by_filter": dropped_filter,
            "rollout/groups_dropped_failed": dropped_failed, "rollout/groups_returned": returned,
            "rollout/samples_failed": failed_samples.failed, "rollout/step_failed": float(failure is not None),
        })
        return ScoredGroups(kept, metrics, returned, exhausted, failure)

    def _prepare_leftover(self, group: Group) -> Group:
        """An unfinished group keeps its tokens under partial rollout, else restarts from its prompt."""
        if all(s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED) for s in group):
            return group
        if not self.cfg.rollout.partial_rollout:
            return [s.reset_to_prompt() if s.status == SampleStatus.ABORTED else s for s in group]
        return group

    def _metrics(self, groups: list[Group], elapsed: float) -> dict[str, float]:
        samples = [s for g in groups for s in g]
        if not samples:
            return {"rollout/time": elapsed}
        key = self.cfg.rollout.reward_key
        rewards = [s.reward_value(key) for s in samples if s.reward is not None]
        lengths = [s.response_length for s in samples]
        return {
            "rollout/reward_mean": statistics.fmean(rewards) if rewards else 0.0,
            "rollout/reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
            "rollout/response_len_mean": statistics.fmean(lengths),
            "rollout/response_len_max": max(lengths),
            "rollout/truncated_frac": sum(s.status == SampleStatus.TRUNCATED for s in samples) / len(samples),
            "rollout/failed_frac": sum(s.status == SampleStatus.FAILED for s in samples) / len(samples),
            "rollout/tokens": sum(lengths),
            "rollout/tokens_per_s": sum(lengths) / elapsed if elapsed > 0 else 0.0,
            "rollout/time": elapsed,
            **_agent_metrics(samples),
        }

    async def evaluate(self, eval_sets: dict[str, list[Group]]) -> dict[str, float]:
        """Mean reward and pass@k (k = eval.n_samples_per_prompt) per eval set."""
        params = sampling_params(self.cfg, evaluation=True)
        self._watch_loop()
        self.enough = False
        metrics: dict[str, float] = {}
        for name, groups in eval_sets.items():
            fresh = [[copy.deepcopy(s).reset_to_prompt() for s in g] for g in groups]
            done = await asyncio.gather(*(self._generate_group(g, params) for g in fresh))
            key = self.cfg.rollout.reward_key
            rewards = [[s.reward_value(key) if s.reward is not None else 0.0 for s in g] for g in done]
            k = len(rewards[0]) if rewards else 1
            metrics[f"eval/{name}/reward_mean"] = statistics.fmean(r for g in rewards for r in g) if rewards else 0.0
            metrics[f"eval/{name}/pass@{k}"] = statistics.fmean(float(max(g) > 0) for g in rewards) if rewards else 0.0
            metrics[f"eval/{name}/response_len_mean"] = statistics.fmean(
                s.response_length for g in done for s in g) if done else 0.0
            metrics[f"eval/{name}/prompts"] = float(len(done))  # what a pass@k difference can be read against
        return metrics


def _agent_metrics(samples: list[Sample]) -> dict[str, float]:
    """Episode metrics of multi-turn samples, and the prefix-cache hit rate where the engine reports it."""
    out: dict[str, float] = {}
    prompt = sum(s.metadata.get("prompt_tokens", 0) for s in samples)
    if prompt and any("cached_tokens" in s.metadata for s in samples):
        out["rollout/prefix_cache_hit_rate"] = sum(s.metadata.get("cached_tokens", 0) for s in samples) / prompt
    episodes = [s.metadata for s in samples if "episode_end" in s.metadata]
    if episodes:
        calls = sum(m["tool_calls"] for m in episodes)
        out["rollout/turns_mean"] = statistics.fmean(m["turns"] for m in episodes)
        out["rollout/tool_calls_mean"] = calls / len(episodes)
        out["rollout/tool_error_frac"] = sum(m["tool_errors"] for m in episodes) / calls if calls else 0.0
        for end in ("final_answer", "max_turns", "context_limit"):
            out[f"rollout/episode_end_{end}_frac"] = sum(m["episode_end"] == end for m in episodes) / len(episodes)
    return out
