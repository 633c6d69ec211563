"""``remote``: score on a reward server over HTTP (slime's ``--rm-type remote_rm --rm-url``).

Each sample is one ``POST`` of JSON ``{"prompt", "response", "label", "metadata"}``
to ``rollout.reward_url``, with ``Authorization: Bearer <rollout.reward_api_key>`` when a key is
set (a `Secret`: inline or ``env:NAME``; never put it in the URL). The server answers a number, or ``{"reward": number}``,
or ``{"reward": {"name": number, ...}}`` (a dict reward; pick one with
``rollout.reward_key``). Connection errors, timeouts, 429 and 5xx answers are
retried with exponential backoff; other 4xx answers are not (the request is
wrong, not the server busy). After the last try the error says what happened.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx

from slime_rl.core.config.secrets import Secret, redact, redact_url
from slime_rl.core.infra.http_retry import NoAnswer, post_retrying
from slime_rl.core.sample import Reward, Sample


class RemoteRewardError(RuntimeError):
    """The reward server could not score a sample; the message says why."""


@dataclass
class RemoteReward:
    url: str = field(repr=False)  # may carry credentials; errors show it through redact_url
    attempts: int = 3
    backoff_s: float = 0.5  # waits backoff_s, 2*backoff_s, ... between tries
    request_timeout_s: float = 10.0  # per try; rollout.reward_timeout bounds the whole call
    api_key: Secret | None = field(default=None, repr=False)

    async def __call__(self, sample: Sample) -> Reward:
        body = json.dumps(
            {"prompt": sample.prompt, "response": sample.response, "label": sample.label,
             "metadata": sample.metadata},
            default=str,  # metadata may hold objects JSON does not know; the server gets their text
        )
        headers = {"content-type": "application/json"}
        if self.api_key is not None:
            headers["authorization"] = f"Bearer {self.api_key.reveal()}"
        shown = redact_url(self.url)  # errors land in logs, metadata.error and step-failure lines
        async with httpx.AsyncClient(timeout=self.request_timeout_s) as client:
            response = await post_retrying(client, self.url, attempts=self.attempts, backoff_s=self.backoff_s,
                                           content=body, headers=headers)
        if isinstance(response, NoAnswer):
            raise RemoteRewardError(f"remote reward {shown}: no answer after {self.attempts} tries; last error"
                                    f" {response.last}")
        if response.status_code >= 400:
            raise RemoteRewardError(f"remote reward {shown} refused the request: "
                                    + redact(f"HTTP {response.status_code}: {response.text[:200]}"))
        return parse_reward_body(response, shown)


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
