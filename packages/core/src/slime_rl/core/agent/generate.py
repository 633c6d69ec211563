"""``rollout.generate_fn: multi_turn``: an agent loop over token ids.

One episode: the model samples an assistant turn (its ids and log-probs appended as they are, loss
mask 1); the turn ends on the template's end-of-turn token or a tool-call close; the tool calls in
its text run; their results, rendered with the chat template's tool role, are appended as ids with
loss mask 0; repeat. The episode ends on a turn without a tool call (``final_answer``), after
``rollout.max_turns`` assistant turns (``max_turns``), or when the response budget
(``rollout.max_response_len``, sampled and observation tokens together) runs out
(``context_limit``); ``sample.metadata["episode_end"]`` says which, and the reward sees the whole
trajectory. Sampled ids are never decoded and re-encoded into what the trainer scores.

With an `Environment` (environment.py; ``rollout.generate_fn: environment``) the environment takes the
place of the tools: it may replace the prompt at ``reset``, gets each turn's text at ``step`` and gives the
observation (appended the same way, loss mask 0), a reward and whether the episode is done
(``final_answer``); the rewards add up in ``sample.metadata["env_reward"]``.

Turns of one episode share a request-id prefix (``<session>/<turn>``) so an engine with several
servers can send them all to the one that holds the episode's prefix in its cache.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from slime_rl.core.agent.environment import Environment, StepResult
from slime_rl.core.agent.template import TurnTemplate, plain_content_ids, render, tool_message
from slime_rl.core.agent.tool_calls import TOOL_CALL_CLOSE, parse_tool_calls
from slime_rl.core.agent.tools import Tool, ToolResult, call_tool, load_tools
from slime_rl.core.contracts import GenerateOutput, RolloutEngine, SamplingParams
from slime_rl.core.sample import Sample, SampleStatus
from slime_rl.core.vision.observation import ObservationImages, image_message, message_images

if TYPE_CHECKING:
    from slime_rl.core.config import Config

EPISODE_ENDS = ("final_answer", "max_turns", "context_limit", "aborted")
_sessions = itertools.count()


@dataclass
class EpisodeStats:
    turns: int = 0  # assistant turns sampled
    tool_calls: int = 0
    tool_errors: int = 0  # calls that raised, timed out, named no tool or could not be read
    prompt_tokens: int = 0  # input ids sent to the engine over all turns
    cached_tokens: int = 0  # of those, what the engine served from its prefix cache (where it reports it)
    cache_reported: bool = False
    env_reward: float | None = None  # an environment's episode: its summed step rewards

    def record(self, sample: Sample, end: str) -> None:
        sample.metadata.update({"episode_end": end, "turns": self.turns, "tool_calls": self.tool_calls,
                                "tool_errors": self.tool_errors})
        if self.env_reward is not None:
            sample.metadata["env_reward"] = self.env_reward
        if self.cache_reported:
            sample.metadata.update({"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens})


class MultiTurnGenerate:
    """The built-in multi-turn generate function; `from_config` builds it in the rollout process."""

    def __init__(self, tokenizer: Any, tools: dict[str, Tool], *, max_turns: int = 4, tool_timeout: float = 30.0,
                 stop_on_tool_call: bool = True, environment: Callable[[], Environment] | None = None,
                 images: ObservationImages | None = None, **template_kwargs: Any):
        self.tokenizer = tokenizer
        self.template = TurnTemplate.from_tokenizer(tokenizer, **template_kwargs)
        self.tools = tools
        self.max_turns = max_turns
        self.tool_timeout = tool_timeout
        self.stop_on_tool_call = stop_on_tool_call and environment is None
        self.environment = environment  # a maker of fresh environments, one per episode
        self.images = images  # observations with pictures (vision-language models; core/vision/observation.py)

    @classmethod
    def from_config(cls, cfg: Config, tokenizer: Any) -> MultiTurnGenerate:
        r = cfg.rollout
        if r.generate_fn == "environment":
            from slime_rl.core.agent.environment import environment_factory

            return cls(tokenizer, {}, max_turns=r.max_turns, environment=environment_factory(r.environment or "", cfg),
                       images=ObservationImages.from_config(cfg))
        return cls(tokenizer, load_tools(list(r.tools), cfg), max_turns=r.max_turns, tool_timeout=r.tool_timeout,
                   images=ObservationImages.from_config(cfg))

    def _turn_params(self, params: SamplingParams, remaining: int) -> SamplingParams:
        stop = list(params.stop) + ([TOOL_CALL_CLOSE] if self.stop_on_tool_call else [])
        stop_ids = list(params.stop_token_ids) + [t for t in self.template.end_of_turn_ids
                                                  if t not in params.stop_token_ids]
        return SamplingParams(**{**params.__dict__, "max_new_tokens": remaining, "stop": stop,
                                 "stop_token_ids": stop_ids})

    async def __call__(self, sample: Sample, params: SamplingParams, engine: RolloutEngine) -> Sample:
        if sample.response_length:  # an aborted episode restarts: tool state cannot be resumed mid-way
            sample.reset_to_prompt()
        session = f"s{sample.index}-{next(_sessions)}"
        stats = EpisodeStats()
        env = self.environment() if self.environment is not None else None
        if env is not None:
            stats.env_reward = 0.0
            first = await env.reset(sample)
            if first is not None:
                self._set_prompt(sample, first)
        budget = params.max_new_tokens
        for turn in range(1, self.max_turns + 1):
            remaining = budget - sample.response_length
            if remaining <= 0:
                return self._end(sample, stats, "context_limit", SampleStatus.TRUNCATED)
            stats.prompt_tokens += len(sample.tokens)
            images = (sample.multimodal_inputs or {}).get("images")  # a vision-language prompt's (docs/vlm.md)
            out = await engine.generate(list(sample.tokens), self._turn_params(params, remaining),
                                        request_id=f"{session}/{turn}", **({"images": list(images)} if images else {}))
            _count_cache(stats, out)
            if turn == 1:
                sample.weight_version = out.weight_version
            sample.append_response(out.token_ids, out.log_probs, trained=True)
            stats.turns += 1
            if out.finish_reason == "abort":
                return self._end(sample, stats, "aborted", SampleStatus.ABORTED)
            if out.finish_reason == "length":
                return self._end(sample, stats, "context_limit", SampleStatus.TRUNCATED)
            ended_on_eot = bool(out.token_ids) and out.token_ids[-1] in self.template.end_of_turn_ids
            if env is not None:
                text = self.tokenizer.decode(out.token_ids[:-1] if ended_on_eot else out.token_ids,
                                             skip_special_tokens=False)
                result: StepResult = await env.step(text)
                stats.env_reward += float(result.reward)
                if result.done:
                    return self._end(sample, stats, "final_answer", SampleStatus.COMPLETED)
                if turn == self.max_turns:
                    return self._end(sample, stats, "max_turns", SampleStatus.COMPLETED)
                messages = ([{"role": env.observation_role, "content": result.observation or ""}]
                            if not isinstance(result.observation, list) else result.observation)
                stats.tool_calls += sum(m.get("role") == "tool" for m in messages)
                observation, refs = self._observation(messages, ended_on_eot)
                if sample.response_length + len(observation) >= budget:
                    return self._end(sample, stats, "context_limit", SampleStatus.TRUNCATED)
                self._append(sample, observation, refs)
                continue
            calls = parse_tool_calls(self.tokenizer.decode(out.token_ids, skip_special_tokens=False))
            if not calls:
                return self._end(sample, stats, "final_answer", SampleStatus.COMPLETED)
            if turn == self.max_turns:
                return self._end(sample, stats, "max_turns", SampleStatus.COMPLETED)
            results: list[ToolResult] = await asyncio.gather(
                *(call_tool(self.tools, call, self.tool_timeout) for call in calls))
            stats.tool_calls += len(results)
            stats.tool_errors += sum(r.error for r in results)
            observation, refs = self._observation(
                [image_message(r.name, r.text, r.images) if r.images else tool_message(r.name, r.text) for r in results],
                ended_on_eot)
            if sample.response_length + len(observation) >= budget:  # no room left for the model to answer
                return self._end(sample, stats, "context_limit", SampleStatus.TRUNCATED)
            self._append(sample, observation, refs)
        raise AssertionError("unreachable: the last turn always ends the episode")

    def _observation(self, messages: list[dict[str, Any]], ended_on_eot: bool) -> tuple[list[int], list[str]]:
        """The observation's ids (each picture's placeholder expanded to its pads) and its pictures."""
        ids = self.template.observation_ids(messages, ended_on_end_of_turn=ended_on_eot)
        refs = message_images(messages)
        if refs and self.images is None:
            raise ValueError("an observation brought images, and the run serves no vision-language data: set "
                             "data.image_key and serve a vision-language model (docs/vlm.md)")
        return (self.images.expand(ids, refs) if refs else ids), refs

    @staticmethod
    def _append(sample: Sample, observation: list[int], refs: list[str]) -> None:
        sample.append_response(observation, None, trained=False)
        if refs:
            ObservationImages.record(sample, refs)

    def _set_prompt(self, sample: Sample, first: str | list[dict[str, Any]]) -> None:
        """The environment's first observation as the prompt: rendered by the chat template, its text plain."""
        messages = [{"role": "user", "content": first}] if isinstance(first, str) else list(first)
        sample.prompt = messages
        sample.multimodal_inputs = sample.multimodal_train_inputs = None  # the data prompt's images went with it
        sample.tokens = plain_content_ids(
            self.tokenizer, lambda ms: render(self.tokenizer, ms, add_generation_prompt=True,
                                              **self.template.template_kwargs),
            messages, specials=self.template.specials)

    @staticmethod
    def _end(sample: Sample, stats: EpisodeStats, end: str, status: SampleStatus) -> Sample:
        sample.status = status
        stats.record(sample, end)
        return sample


def _count_cache(stats: EpisodeStats, out: GenerateOutput) -> None:
    cached = getattr(out, "cached_tokens", None)
    if cached is not None:
        stats.cached_tokens += cached
        stats.cache_reported = True
