"""SGLang's server control API as a weight sync and the engine's memory calls use it: `Target` (a server
as a control call sees it, with its admin key), `post` (one call, checked, raising `WeightSyncError`
that names the server and the step), and pause / continue / flush / release / resume memory.

The transports (ipc.py, nccl.py, disk.py) and the checks (verify.py) post through this module. Plain
blocking functions: the trainer process calls them directly; the async engine runs them in a thread. A call
to one server goes through httpx; a call to every server at once (`post_all`, `flush_cache`) through one
aiohttp session on a control thread of the process.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
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
    resp = _request(target, "POST", path, timeout=timeout, step=step, **payload)
    return _checked(target, path, step, resp.status_code, resp.text, ok_status)


def _request(target: Target, method: str, path: str, *, timeout: float, step: str, **request: Any) -> httpx.Response:
    """One call through the server's client; a timeout or transport failure as `WeightSyncError`."""
    try:
        return _client(target.url).request(method, f"{target.url}{path}", timeout=timeout, **request)
    except httpx.TimeoutException:
        raise WeightSyncError(f"{target.name}: {step}: {path} timed out after {timeout:.0f} s") from None
    except httpx.HTTPError as err:
        raise WeightSyncError(f"{target.name}: {step}: {path} failed: {type(err).__name__}: {err}") from None


def _checked(target: Target, path: str, step: str, status: int, text: str, ok_status: tuple[int, ...] = (200,)) -> Any:
    """SGLang's answer, or `WeightSyncError`: an HTTP status not in ``ok_status``, or ``success: false``."""
    if status not in ok_status:
        raise WeightSyncError(f"{target.name}: {step}: {path} answered HTTP {status}: {text[:500]}")
    try:
        data = json.loads(text)
    except ValueError:
        return text
    if isinstance(data, dict) and data.get("success") is False:
        raise WeightSyncError(f"{target.name}: {step}: {path} failed: "
                              f"{data.get('message') or data.get('error_message')}")
    return data


def get(target: Target, path: str, *, timeout: float, step: str) -> Any:
    """GET one of SGLang's NORMAL endpoints (``/model_info``, ``/server_info``) with the API key; its JSON."""
    resp = _request(target, "GET", path, timeout=timeout, step=step, headers=bearer(target.api_key))
    return _checked(target, path, step, resp.status_code, resp.text)


def reachable(target: Target, timeout: float = 5.0) -> bool:
    """Whether the server accepts connections at all (any answer to ``/health``, even 503, counts)."""
    try:
        _client(target.url).get(f"{target.url}/health", timeout=timeout)
    except httpx.TransportError:
        return False
    return True


class _ControlLoop:
    """One event loop thread and aiohttp session per process for calls to many servers at once: 0.07 ms of CPU
    a request at 128 servers, where a thread and an httpx client a server cost ~0.6 ms (docs/scale.md)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="slime-rl-control-calls", daemon=True).start()
        self.session = self.run(self._session())

    @staticmethod
    async def _session() -> aiohttp.ClientSession:
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    def run(self, coro: Any) -> Any:
        """``coro``'s result, from blocking code (never from this loop's own thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()


_control: _ControlLoop | None = None
_control_lock = threading.Lock()


def _control_loop() -> _ControlLoop:
    global _control
    with _control_lock:
        if _control is None or _control.pid != os.getpid():  # a forked child has no thread behind the loop
            _control = _ControlLoop()
            atexit.register(_close_control_loop, _control)
        return _control


def _close_control_loop(control: _ControlLoop) -> None:
    """At exit, while its thread still runs: close the session (else aiohttp warns of unclosed connections)."""
    if control.pid == os.getpid():
        with contextlib.suppress(Exception):  # exiting anyway; a stuck close must not hold the exit
            asyncio.run_coroutine_threadsafe(control.session.close(), control.loop).result(timeout=2)


async def _post_async(session: aiohttp.ClientSession, target: Target, path: str, body: dict[str, Any] | bytes | None,
                      *, timeout: float, step: str) -> Any:
    """`post` on the control loop: the same answers and errors."""
    if isinstance(body, bytes):
        payload: dict[str, Any] = {"data": body, "headers": {**target.headers, "content-type": "application/json"}}
    else:
        payload = {"json": body if body is not None else {}, "headers": target.headers}
    return await _request_async(session, target, "POST", path, timeout=timeout, step=step, **payload)


async def _request_async(session: aiohttp.ClientSession, target: Target, method: str, path: str, *, timeout: float,
                         step: str, **request: Any) -> Any:
    """`_request` and `_checked` on the control loop."""
    try:
        async with session.request(method, f"{target.url}{path}", timeout=aiohttp.ClientTimeout(total=timeout),
                                   **request) as resp:
            status, text = resp.status, await resp.text()
    except TimeoutError:
        raise WeightSyncError(f"{target.name}: {step}: {path} timed out after {timeout:.0f} s") from None
    except aiohttp.ClientError as err:
        raise WeightSyncError(f"{target.name}: {step}: {path} failed: {type(err).__name__}: {err}") from None
    return _checked(target, path, step, status, text)


async def _gathered(calls: list) -> list[Any]:
    """Every call's result; the first failure raised after all returned."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def post_all(targets: list[Target], path: str, body: Callable[[int, Target], dict | bytes] | dict | None, *,
             timeout: float, step: str) -> list[Any]:
    """The same call on every engine at once; the first failure is raised after all returned."""
    if not targets:
        return []
    control = _control_loop()
    return control.run(_gathered([_post_async(control.session, t, path, body(i, t) if callable(body) else body,
                                              timeout=timeout, step=step) for i, t in enumerate(targets)]))


def get_all(targets: list[Target], path: str, *, timeout: float, step: str) -> list[Any]:
    """`get` on every engine at once; the first failure is raised after all returned."""
    if not targets:
        return []
    control = _control_loop()
    return control.run(_gathered([_request_async(control.session, t, "GET", path, timeout=timeout, step=step,
                                                 headers=bearer(t.api_key)) for t in targets]))


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
    if targets:
        control = _control_loop()
        control.run(_gathered([_flush_async(control.session, t, timeout=timeout, step=step) for t in targets]))


async def _flush_async(session: aiohttp.ClientSession, target: Target, *, timeout: float, step: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            async with session.post(f"{target.url}/flush_cache", headers=target.headers,
                                    timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                if resp.status == 200:
                    return
                problem = f"HTTP {resp.status}: {(await resp.text()).strip()[:200]}"
        except aiohttp.ClientConnectorError as err:
            raise WeightSyncError(f"{target.name}: {step}: /flush_cache failed: {type(err).__name__}: {err}") from None
        except (TimeoutError, aiohttp.ClientError) as err:
            problem = f"{type(err).__name__}: {err}"
        if time.monotonic() >= deadline:
            raise WeightSyncError(f"{target.name}: {step}: /flush_cache did not succeed within "
                                  f"{timeout:.0f} s; last: {problem}")
        await asyncio.sleep(0.1)


def release_memory(targets: list[Target], tags: list[str] | None, *, timeout: float) -> None:
    post_all(targets, "/release_memory_occupation", {"tags": tags}, timeout=timeout, step="release memory")


def resume_memory(targets: list[Target], tags: list[str] | None, *, timeout: float) -> None:
    post_all(targets, "/resume_memory_occupation", {"tags": tags}, timeout=timeout, step="resume memory")
