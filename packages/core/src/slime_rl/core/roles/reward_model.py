"""The ``reward_model`` reward: a scalar-head model served as a role (kind reward_model) scores each sample's
prompt and response. Calls arriving together (a group, the groups of a wave) go in one ``/classify``
request of up to the role's ``batch_size`` texts; a failed request fails its samples as any reward failure
does (rewards/__init__.py counts them)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from slime_rl.core.roles.client import RoleClient
from slime_rl.core.roles.endpoints import read_endpoints
from slime_rl.core.sample import Sample

GATHER_WINDOW_S = 0.005  # after a call, wait this long for the rest of its wave


def reward_model_text(sample: Sample) -> str:
    """What the reward model reads: the prompt (chat messages: their contents, in order) and the response."""
    prompt = sample.prompt
    if isinstance(prompt, list):
        prompt = "\n".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in prompt)
    return f"{prompt}{sample.response}"


@dataclass
class RewardModelReward:
    client: RoleClient | None  # None: the run's reward-model role, read from the endpoints file at each request
    batch_size: int = 32
    _queue: list[tuple[str, asyncio.Future]] = field(default_factory=list, repr=False)
    _flushing: asyncio.Task | None = field(default=None, repr=False)

    @classmethod
    def from_endpoints(cls) -> RewardModelReward:
        """The run's one reward-model role (the endpoints file the run wrote; core/roles/endpoints.py)."""
        models = [e for e in read_endpoints().values() if e.kind == "reward_model"]
        if len(models) != 1:
            raise LookupError(f"rollout.reward=reward_model needs one role of kind reward_model; the run serves"
                              f" {len(models)}")
        return cls(None, batch_size=models[0].batch_size)

    def _client(self) -> RoleClient:
        if self.client is not None:
            return self.client
        # read at each request: a role restarted on another port is found
        return next(e for e in read_endpoints().values() if e.kind == "reward_model").client()

    async def __call__(self, sample: Sample) -> float:
        future = asyncio.get_running_loop().create_future()
        self._queue.append((reward_model_text(sample), future))
        if self._flushing is None or self._flushing.done():
            self._flushing = asyncio.ensure_future(self._flush())
        return await future

    async def _flush(self) -> None:
        await asyncio.sleep(GATHER_WINDOW_S)
        while self._queue:
            batch, self._queue = self._queue[:self.batch_size], self._queue[self.batch_size:]
            asyncio.ensure_future(self._score(batch))

    async def _score(self, batch: list[tuple[str, asyncio.Future]]) -> None:
        try:
            scores = await self._client().classify([text for text, _ in batch])
        except Exception as err:  # every sample of the request fails with the same reason
            for _, future in batch:
                if not future.done():
                    future.set_exception(err)
            return
        for (_, future), score in zip(batch, scores, strict=True):
            if not future.done():
                future.set_result(score)


_shared: dict[int, RewardModelReward] = {}


def shared_reward_model() -> RewardModelReward:
    """One instance per event loop: calls from every group of a wave share its batches."""
    loop = id(asyncio.get_running_loop())
    if loop not in _shared:
        _shared[loop] = RewardModelReward.from_endpoints()
    return _shared[loop]


async def reward_model_reward(sample: Sample) -> float:
    """The built-in ``reward_model`` reward (rollout.reward=reward_model)."""
    return await shared_reward_model()(sample)
