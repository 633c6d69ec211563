"""POST with retries, for the run's calls to servers it does not run (a remote reward, a served role): a
connection error, a timeout, 429 or a 5xx is tried again after ``backoff_s``, ``2 * backoff_s``, ...;
any other answer, a 4xx included, is the caller's to read. What went wrong is redacted (config/secrets.py),
since it lands in logs, ``metadata.error`` and step-failure lines."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import httpx

from slime_rl.core.config.secrets import redact


@dataclass(frozen=True)
class NoAnswer:
    """Every try failed; ``last`` says how the last one did."""

    last: str


async def post_retrying(client: httpx.AsyncClient, url: str, *, attempts: int, backoff_s: float,
                        timeout_text: str | None = None, **request: Any) -> httpx.Response | NoAnswer:
    """The first answer not worth another try, or `NoAnswer` after ``attempts`` tries. ``timeout_text``:
    how a timed-out try reads (default: the exception's name and text)."""
    last = ""
    for attempt in range(attempts):
        if attempt:
            await asyncio.sleep(backoff_s * 2 ** (attempt - 1))
        try:
            response = await client.post(url, **request)
        except httpx.TransportError as err:  # timeouts included
            timed_out = isinstance(err, httpx.TimeoutException) and timeout_text is not None
            last = timeout_text if timed_out else redact(f"{type(err).__name__}: {err or 'no detail'}")
            continue
        if response.status_code == 429 or response.status_code >= 500:
            last = redact(f"HTTP {response.status_code}: {response.text[:200]}")
            continue
        return response
    return NoAnswer(last)
