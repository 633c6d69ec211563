"""`RoleClient`: the run's one way to call a served role (teacher, reward model, judge) over HTTP.

It speaks the subset of SGLang 0.5.17's native API that roles need, which the hf engine's role server
(rollout_hf/role_server.py) also answers, so one client serves CPU and GPU runs:

- ``POST /generate`` with ``input_ids``, ``sampling_params.max_new_tokens = 0``, ``return_logprob`` and
  ``logprob_start_len = 0``: a prefill only; ``meta_info.input_token_logprobs`` holds ``[log-prob, id, text]``
  for every input token (the first one's log-prob is None: nothing predicts it);
- ``POST /generate`` with ``text``: a judge's answer (``text`` of the reply);
- ``POST /classify`` with ``text`` (a list): a scalar-head reward model's score, ``embedding[0]`` of each reply
  (SGLang serves these models with ``--is-embedding``; its ``/v1/classify`` softmaxes the logits, which for
  one label is always 1.0, so the native endpoint is the one used);
- ``GET /health``.

Every request sends the role's key as a bearer token, waits at most ``timeout_s``, and is retried on
connection errors, timeouts, 429 and 5xx, with backoff, ``attempts`` times in all; a 4xx is not retried.
Errors say what failed with the key and any URL credentials redacted (config/secrets.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx

from slime_rl.core.config.secrets import redact, redact_url, remember
from slime_rl.core.infra.http_retry import NoAnswer, post_retrying


class RoleError(RuntimeError):
    """A role's server did not answer usefully; the message says why (its key and URL credentials redacted)."""


@dataclass
class RoleClient:
    name: str  # the role's name (roles.<name>), for messages
    url: str = field(repr=False)
    api_key: str | None = field(default=None, repr=False)
    timeout_s: float = 60.0
    attempts: int = 3
    backoff_s: float = 0.2  # waits backoff_s, 2 * backoff_s, ... between tries

    def __post_init__(self) -> None:
        if self.api_key:
            remember(self.api_key)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def post(self, path: str, body: dict[str, Any], *, timeout_s: float | None = None,
                   attempts: int | None = None) -> Any:
        """``body`` POSTed to ``path``; the JSON reply. RoleError after the last try (or at once on a 4xx)."""
        timeout = timeout_s if timeout_s is not None else self.timeout_s
        tries = attempts if attempts is not None else self.attempts
        async with httpx.AsyncClient(timeout=timeout) as client:
            response = await post_retrying(client, self.url + path, attempts=tries, backoff_s=self.backoff_s,
                                           timeout_text=f"no answer within {timeout:g} s", json=body,
                                           headers=self.headers)
        if isinstance(response, NoAnswer):
            raise RoleError(f"role {self.name} ({redact_url(self.url)}{path}): no answer after {tries} tries;"
                            f" last: {response.last}")
        if response.status_code >= 400:
            raise RoleError(f"role {self.name} ({redact_url(self.url)}{path}) refused the request: "
                            + redact(f"HTTP {response.status_code}: {response.text[:200]}"))
        try:
            return response.json()
        except ValueError:
            raise RoleError(f"role {self.name} answered {path} with non-JSON: "
                            f"{redact(response.text[:200])!r}") from None

    async def healthy(self, timeout_s: float = 5.0) -> bool:
        try:
            async with httpx.AsyncClient(timeout=timeout_s) as client:
                return (await client.get(self.url + "/health")).status_code == 200
        except httpx.HTTPError:
            return False

    async def prefill_log_probs(self, token_ids: list[list[int]], response_lengths: list[int]) -> list[list[float]]:
        """Each sequence's log-probs of its last ``response_length`` tokens, each given the tokens before it:
        one prefill request for all of them, nothing generated."""
        if not token_ids:
            return []
        replies = await self.post("/generate", {
            "input_ids": token_ids, "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 0, "temperature": 1.0}})
        replies = replies if isinstance(replies, list) else [replies]
        if len(replies) != len(token_ids):
            raise RoleError(f"role {self.name}: {len(replies)} answers to {len(token_ids)} prefill requests")
        out = []
        for reply, ids, length in zip(replies, token_ids, response_lengths, strict=True):
            entries = (reply.get("meta_info") or {}).get("input_token_logprobs") or []
            if len(entries) < length or length > len(ids) - 1:
                raise RoleError(f"role {self.name}: {len(entries)} input log-probs for a sequence of {len(ids)} tokens"
                                f" whose last {length} are scored")
            tail = entries[len(entries) - length:] if length else []
            values = [entry[0] for entry in tail]
            if any(v is None for v in values):
                raise RoleError(f"role {self.name}: a scored token has no log-prob (prompt of no tokens?)")
            out.append([float(v) for v in values])
        return out

    async def classify(self, texts: list[str]) -> list[float]:
        """A reward model's scalar score of each text, in one request."""
        if not texts:
            return []
        replies = await self.post("/classify", {"text": texts})
        replies = replies if isinstance(replies, list) else [replies]
        if len(replies) != len(texts):
            raise RoleError(f"role {self.name}: {len(replies)} scores for {len(texts)} texts")
        scores = []
        for reply in replies:
            embedding = reply.get("embedding") if isinstance(reply, dict) else None
            if not isinstance(embedding, list) or not embedding or not isinstance(embedding[0], int | float):
                raise RoleError(f"role {self.name}: /classify answered {str(reply)[:200]!r}; expected"
                                " {\"embedding\": [score]} (a ...ForSequenceClassification with one label)")
            scores.append(float(embedding[0]))
        return scores

    async def generate(self, prompt: str, *, max_new_tokens: int = 64, temperature: float = 0.0,
                       timeout_s: float | None = None, **sampling: Any) -> str:
        """A judge's answer to ``prompt`` (text in, text out)."""
        reply = await self.post("/generate", {
            "text": prompt, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": temperature,
                                                **sampling}}, timeout_s=timeout_s)
        if not isinstance(reply, dict) or not isinstance(reply.get("text"), str):
            raise RoleError(f"role {self.name}: /generate answered {str(reply)[:200]!r}; expected {{\"text\": ...}}")
        return reply["text"]
