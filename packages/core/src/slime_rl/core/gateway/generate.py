"""``rollout.generate_fn: gateway``: run the user's own agent per sample against the run's gateway, and
train on what it made the model sample.

The agent is ``rollout.gateway.agent`` (``module:attr``: ``async def run(base_url, api_key, sample)``, which
talks to the OpenAI API at ``base_url`` with ``api_key`` and returns the episode's reward, or any final
state) or ``rollout.gateway.command`` (a program run per sample with ``OPENAI_BASE_URL``,
``OPENAI_API_KEY`` and ``SLIME_RL_MODEL`` in its environment and the sample as JSON on stdin, its last
line of stdout a JSON value: the reward, or any final state). A number it returns is
``sample.metadata["agent_reward"]`` (``rollout.reward: slime_rl.core.gateway:agent_reward`` trains on
it); anything else is ``metadata["agent_result"]``, for the run's reward function to read.

An agent that raises, exits non-zero, outlasts ``rollout.gateway.agent_timeout`` or makes no model call
fails its sample (``metadata["error"]`` says why; ``rollout.max_failed_fraction`` counts it). An episode
the rollout aborts (it had enough groups) is ABORTED and starts again from its prompt when resumed: an
agent's state cannot be resumed mid-way.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from slime_rl.core.config.secrets import redact
from slime_rl.core.contracts import RolloutEngine, SamplingParams
from slime_rl.core.gateway.samples import episode_metadata, episode_samples, sampled_calls
from slime_rl.core.gateway.server import Gateway, GatewaySettings
from slime_rl.core.sample import Sample, SampleStatus

if TYPE_CHECKING:
    from slime_rl.core.config import Config

Agent = Callable[[str, str, Sample], Any]


class GatewayGenerate:
    """The ``gateway`` generate function: one gateway per engine, one episode per sample."""

    def __init__(self, tokenizer: Any, *, agent: Agent | None = None, command: list[str] | None = None,
                 samples: str = "trajectory", agent_timeout: float = 600.0,
                 settings: GatewaySettings | None = None, run_key: str | None = None):
        if (agent is None) == (not command):
            raise ValueError("rollout.gateway: give exactly one of agent (module:attr) and command")
        self.tokenizer, self.agent, self.command = tokenizer, agent, list(command or [])
        self.samples, self.agent_timeout = samples, agent_timeout
        self.settings = settings or GatewaySettings()
        self.run_key = run_key
        self.gateway: Gateway | None = None

    @classmethod
    def from_config(cls, cfg: Config, tokenizer: Any) -> GatewayGenerate:
        from slime_rl.core.infra.plugins import load_function

        g = cfg.rollout.gateway
        agent = load_function(g.agent, {}, what="rollout.gateway.agent") if g.agent else None
        return cls(tokenizer, agent=agent, command=g.command, samples=g.samples, agent_timeout=g.agent_timeout,
                   settings=GatewaySettings(model=g.model, tool_parser=g.tool_parser, gc_freeze=g.gc_freeze,
                                            gc_threshold=tuple(g.gc_threshold) if g.gc_threshold else None),
                   run_key=g.api_key.reveal() if g.api_key is not None else None)

    def gateway_for(self, engine: RolloutEngine) -> Gateway:
        if self.gateway is None or self.gateway.engine is not engine:
            self.gateway = Gateway(engine, self.tokenizer, self.settings, run_key=self.run_key)
        return self.gateway

    async def __call__(self, sample: Sample, params: SamplingParams, engine: RolloutEngine) -> Sample | list[Sample]:
        gateway = self.gateway_for(engine)
        await gateway.start()
        if sample.response_length:  # an aborted episode restarts: an agent cannot be resumed mid-way
            sample.reset_to_prompt()
        episode = gateway.open_episode(params)
        error, result = None, None
        try:
            result = await asyncio.wait_for(self._run(gateway.base_url(episode), episode.key, sample),
                                            self.agent_timeout)
        except TimeoutError:
            error = f"agent: timed out after {self.agent_timeout:g} s (rollout.gateway.agent_timeout)"
        except Exception as err:  # the agent's own failure; an abort's refusal shows as one too
            error = redact(f"agent: {type(err).__name__}: {err}")[:2000]
        finally:
            gateway.close_episode(episode)
        if episode.aborted:
            sample.reset_to_prompt()
            sample.status = SampleStatus.ABORTED
            sample.metadata["episode_end"] = "aborted"
            return sample
        if error is None and not sampled_calls(episode):
            error = "agent: made no model call through the gateway; have it use the base_url and api_key it is given"
        if error is not None:
            sample.status = SampleStatus.FAILED
            sample.metadata.update({"error": error, **episode_metadata(episode)})
            return sample
        out = episode_samples(sample, episode, self.samples)
        for s in out:
            s.metadata["episode_end"] = "final_answer"
            if isinstance(result, (int, float)) and not isinstance(result, bool):
                s.metadata["agent_reward"] = float(result)
            elif result is not None:
                s.metadata["agent_result"] = result
        return out[0] if len(out) == 1 else out

    async def _run(self, base_url: str, api_key: str, sample: Sample) -> Any:
        if self.agent is not None:
            result = self.agent(base_url, api_key, sample)
            return await result if asyncio.iscoroutine(result) or asyncio.isfuture(result) else result
        return await self._run_command(base_url, api_key, sample)

    async def _run_command(self, base_url: str, api_key: str, sample: Sample) -> Any:
        env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key, "SLIME_RL_MODEL":
               self.settings.model}
        stdin = json.dumps({"index": sample.index, "prompt": sample.prompt, "label": sample.label,
                            "metadata": sample.metadata}, default=str).encode()
        proc = await asyncio.create_subprocess_exec(*self.command, stdin=asyncio.subprocess.PIPE,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                    env=env, start_new_session=True)
        try:
            out, err = await proc.communicate(stdin)
        except BaseException:  # timed out or cancelled: the agent and whatever it started go
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await proc.wait()
            raise
        if proc.returncode != 0:
            tail = err.decode(errors="replace").strip().splitlines()[-5:]
            raise RuntimeError(f"{self.command[0]} exited with {proc.returncode}: {' | '.join(tail)}")
        lines = [line for line in out.decode(errors="replace").splitlines() if line.strip()]
        if not lines:
            return None
        try:
            return json.loads(lines[-1])
        except json.JSONDecodeError:
            return lines[-1]


def agent_reward(sample: Sample) -> float:
    """``rollout.reward: slime_rl.core.gateway:agent_reward``: the reward the agent returned."""
    if "agent_reward" not in sample.metadata:
        raise ValueError("the agent returned no number; return the reward from run(), or print it last")
    return float(sample.metadata["agent_reward"])
