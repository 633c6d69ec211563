"""SGLang's server control API as a weight sync and the engine's memory calls use it: `Target` (a server
as a control call sees it, with its admin key), `post` (one call, checked, raising `WeightSyncError`
that names the server and the step), and pause / continue / flush / release / resume memory.

The transports (ipc.py, nccl.py, disk.py) and the checks (verify.py) post through this module. Plain
blocking functions: the trainer process calls them directly; the async engine runs them in a thread.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

from slime_rl.rollout_sglang.keys import bearer


@functools.cache
def _client(base_url: str) -> httpx.Client:
    """One client per server and process, kept alive (thread-safe). ``httpx.post`` builds a client per call,
    ~15 ms of CPU each (its TLS context); and one client shared by every server costs ~4 ms of CPU a request
    when a sync posts to 128 servers at once (httpcore's pool matches every waiting request against every
    connection: quadratic in the servers), ~0.6 ms with a client each (docs/scale.md). Plain-HTTP servers
    skip loading the CA bundle (no TLS to verify)."""
    return httpx.Client(verify=not base_url.startswith("http://"),
                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))


class WeightSyncError(RuntimeError):
    """A step of a weight sync or a control call failed; the message names the server and the step."""


@dataclass(frozen=True)
class Target:
    """An engine as a sync sees it."""

    name: str  # for messages, e.g. "sglang engine 0 (http://127.0.0.1:30001)"
    url: str
    tp_size: int = 1
    admin_key: str | None = field(default=None, repr=False)  # the server's --admin-api-key (keys.py)
    api_key: str | None = field(default=None, repr=False)  # its --api-key, for the endpoints SGLang marks NORMAL

    @property
    def headers(self) -> dict[str, str]:
        return bearer(self.admin_key)


def post(target: Target, path: str, body: dict[str, Any] | bytes | None, *, timeout: float, step: str,
         ok_status: tuple[int, ...] = (200,), api_key: bool = False) -> Any:
    """POST and check SGLang's answer (HTTP 200 and, where present, ``success: true``). ``body``: a dict, or
    its JSON already encoded (one encoding for many engines). The admin key goes with it, or with
    ``api_key`` the API key (SGLang takes only that one on its NORMAL endpoints, such as
    ``/load_lora_adapter_from_tensors``, when both are set)."""
    headers = bearer(target.api_key) if api_key else target.headers
    if isinstance(body, bytes):
        payload = {"content": body, "headers": {**headers, "content-type": "application/json"}}
    else:
        payload = {"json": body if body is not None else {}, "headers": headers}
    try:
        resp = _client(target.url).post(f"{target.url}{path}", timeout=timeout, **payload)
    except httpx.TimeoutException:
        raise WeightSyncError(f"{target.name}: {step}: {path} timed out after {timeout:.0f} s") from None
    except httpx.HTTPError as err:
        raise WeightSyncError(f"{target.name}: {step}: {path} failed: {type(err).__name__}: {err}") from None
    if resp.status_code not in ok_status:
        raise WeightSyncError(f"{target.name}: {step}: {path} answered HTTP {resp.status_code}: {resp.text[:500]}")
    try:
        data = resp.json()
    except ValueError:
        return resp.text
    if isinstance(data, dict) and data.get("success") is False:
        raise WeightSyncError(f"{target.name}: {step}: {path} failed: "
                              f"{data.get('message') or data.get('error_message')}")
    return data


def get(target: Target, path: str, *, timeout: float, step: str) -> Any:
    """GET one of SGLang's NORMAL endpoints (``/model_info``, ``/server_info``) with the API key; its JSON."""
    try:
        resp = _client(target.url).get(f"{target.url}{path}", timeout=timeout, headers=bearer(target.api_key))
    except httpx.TimeoutException:
        raise WeightSyncError(f"{target.name}: {step}: {path} timed out after {timeout:.0f} s") from None
    except httpx.HTTPError as err:
        raise WeightSyncError(f"{target.name}: {step}: {path} failed: {type(err).__name__}: {err}") from None
    if resp.status_code != 200:
        raise WeightSyncError(f"{target.name}: {step}: {path} answered HTTP {resp.status_code}: {resp.text[:500]}")
    return resp.json()


def reachable(target: Target, timeout: float = 5.0) -> bool:
    """Whether the server accepts connections at all (any answer to ``/health``, even 503, counts)."""
    try:
        _client(target.url).get(f"{target.url}/health", timeout=timeout)
    except httpx.TransportError:
        return False
    return True


def post_all(targets: list[Target], path: str, body: Callable[[int, Target], dict] | dict | None, *,
             timeout: float, step: str) -> list[Any]:
    """The same call on every engine at once; the first failure is raised after all returned."""
    if not targets:
        return []
    with ThreadPoolExecutor(len(targets)) as pool:
        futures = [pool.submit(post, t, path, body(i, t) if callable(body) else body, timeout=timeout, step=step)
                   for i, t in enumerate(targets)]
        return [f.result() for f in futures]


def pause_generation(targets: list[Target], *, timeout: float, step: str, mode: str = "abort") -> None:
    """Stop generating until `continue_generation`: ``abort`` (SGLang's default) aborts in-flight requests
    (they return what they have); ``in_place`` (fully async) holds them where they are, KV cache and all,
    and they go on with the new weights, without a re-prefill. New requests wait either way."""
    post_all(targets, "/pause_generation", {"mode": mode}, timeout=timeout, step=step)


def continue_generation(targets: list[Target], *, timeout: float, step: str) -> None:
    post_all(targets, "/continue_generation", {}, timeout=timeout, step=step)


def flush_cache(targets: list[Target], *, timeout: float, step: str) -> None:
    """Drop the prefix cache (its KV came from the old weights). SGLang refuses (HTTP 400)
    while requests are pending, so poll until it succeeds. A server that refuses the connection is
    gone (no retry brings it back; its restart flushes anyway): that fails at once. All engines at
    once; the first failure is raised after all returned."""
    if len(targets) > 1:
        with ThreadPoolExecutor(len(targets)) as pool:
            for future in [pool.submit(flush_cache, [t], timeout=timeout, step=step) for t in targets]:
                future.result()
        return
    for target in targets:
        deadline = time.monotonic() + timeout
        while True:
            try:
                resp = _client(target.url).post(f"{target.url}/flush_cache", headers=target.headers, timeout=timeout)
                if resp.status_code == 200:
                    break
                problem = f"HTTP {resp.status_code}: {resp.text.strip()[:200]}"
            except httpx.ConnectError as err:
                raise WeightSyncError(f"{target.name}: {step}: /flush_cache failed: {type(err).__name__}: {err}") from None
            except httpx.HTTPError as err:
                problem = f"{type(err).__name__}: {err}"
            if time.monotonic() >= deadline:
                raise WeightSyncError(f"{target.name}: {step}: /flush_cache did not succeed within "
                                      f"{timeout:.0f} s; last: {problem}")
            time.sleep(0.1)


def release_memory(targets: list[Target], tags: list[str] | None, *, timeout: float) -> None:
    post_all(targets, "/release_memory_occupation", {"tags": tags}, timeout=timeout, step="release memory")


def resume_memory(targets: list[Target], tags: list[str] | None, *, timeout: float) -> None:
    post_all(targets, "/resume_memory_occupation", {"tags": tags}, timeout=timeout, step="resume memory")
