"""``remote``: score on a reward server over HTTP (slime's ``--rm-type remote_rm --rm-url``).

Each sample is one ``POST`` of JSON ``{"prompt", "response", "label", "metadata"}``
to ``rollout.reward_url``. The server answers a number, or ``{"reward": number}``,
or ``{"reward": {"name": number, ...}}`` (a dict reward; pick one with
``rollout.reward_key``). Connection errors, timeouts, 429 and 5xx answers are
retried with exponential backoff; other 4xx answers are not (the request is
wrong, not the server busy). After the last try the error says what happened.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import httpx

from slime_rl.core.sample import Reward, Sample


class RemoteRewardError(RuntimeError):
    """The reward server could not score a sample; the message says why."""


@dataclass
class RemoteReward:
    url: str
    attempts: int = 3
    backoff_s: float = 0.5  # waits backoff_s, 2*backoff_s, ... between tries
    request_timeout_s: float = 10.0  # per try; rollout.reward_timeout bounds the whole call

    async def __call__(self, sample: Sample) -> Reward:
        body = json.dumps(
            {"prompt": sample.prompt, "response": sample.response, "label": sample.label,
             "metadata": sample.metadata},
            default=str,  # metadata may hold objects JSON does not know; the server gets their text
        )
        last = ""
        async with httpx.AsyncClient(timeout=self.request_timeout_s) as client:
            for attempt in range(self.attempts):
                if attempt:
                    await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
                try:
                    response = await client.post(self.url, content=body,
                                                 headers={"content-type": "application/json"})
                except httpx.TransportError as err:
                    last = f"{type(err).__name__}: {err or 'no detail'}"
                    continue
                if response.status_code == 429 or response.status_code >= 500:
                    last = f"HTTP {response.status_code}: {response.text[:200]}"
                    continue
                if response.status_code >= 400:
                    raise RemoteRewardError(f"remote reward {self.url} refused the request: "
                                            f"HTTP {response.status_code}: {response.text[:200]}")
                return parse_reward_body(response, self.url)
        raise RemoteRewardError(f"remote reward {self.url}: no answer after {self.attempts} tries; last error {last}")


def parse_reward_body(response: httpx.Response, url: str) -> Reward:
    try:
        data: Any = response.json()
    except ValueError:
        raise RemoteRewardError(f"remote reward {url} answered non-JSON: {response.text[:200]!r}") from None
    if isinstance(data, dict) and "reward" in data:
        data = data["reward"]
    if isinstance(data, int | float) and not isinstance(data, bool):
        return float(data)
    if isinstance(data, dict) and data and all(isinstance(v, int | float) for v in data.values()):
        return {str(k): float(v) for k, v in data.items()}
    raise RemoteRewardError(f"remote reward {url} answered {response.text[:200]!r}; expected a number, "
                            '{"reward": number} or {"reward": {"name": number}}')
