"""A run-owned HTTP server on loopback that answers only requests carrying a key.

The run's own servers (the agent gateway, core/gateway; the elastic engines' control endpoint) are one
kind of thing: they live in a run's process, on its asyncio loop, bound to ``127.0.0.1`` only (never every
interface: `net.listening_socket` refuses that), and every route but the ones named open refuses a
request without ``Authorization: Bearer <key>`` (or ``api-key: <key>``, Azure's header, which some
OpenAI clients send) with a 401 in OpenAI's error shape. Keys are compared in constant time and
remembered as secrets (`config.secrets.remember`), so no error text or log shows them.

Which key a request needs is the caller's rule (``key_for``): one key for the whole server, or one key
per path (the gateway derives each episode's key from the run's key and the episode's id, so an agent
holding its key reaches its own episode and no other).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from slime_rl.core.config.secrets import remember
from slime_rl.core.infra.net import LOOPBACK, is_loopback, listening_socket

Handler = Callable[[Any], Awaitable[Any]]  # aiohttp.web.Request -> aiohttp.web.StreamResponse


def new_key(prefix: str = "sk") -> str:
    """A fresh random key (hex after a letter: never read as a flag or a YAML number)."""
    key = prefix + secrets.token_hex(32)
    remember(key)
    return key


def derived_key(run_key: str, name: str, prefix: str = "sk-") -> str:
    """A key for one part of a server (``name``: an episode's id) that only the holder of ``run_key`` can make."""
    key = prefix + hmac.new(run_key.encode(), name.encode(), hashlib.sha256).hexdigest()
    remember(key)
    return key


def error_body(message: str, kind: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def presented_key(headers: Any) -> str | None:
    auth = headers.get("Authorization", "")
    if auth.startswith("Bearer "):
        return auth[len("Bearer "):].strip()
    return headers.get("api-key") or None


@dataclass
class KeyedLoopbackServer:
    """``routes`` (method, path pattern, handler) served on ``host`` (loopback) behind a key.

    ``key_for(request)`` gives the key a request must present (None: refuse it); ``open_paths`` need none
    (a health check). Start it on the loop that will run the handlers (`start`), stop it with `stop`."""

    routes: list[tuple[str, str, Handler]]
    key_for: Callable[[Any], str | None]
    host: str = LOOPBACK
    port: int = 0  # 0: a free one, read back from `url` after `start`
    open_paths: frozenset[str] = frozenset()
    name: str = "server"  # in error messages: "the agent gateway"
    _runner: Any = field(default=None, repr=False)
    _socket: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not is_loopback(self.host):
            raise ValueError(f"{self.name}: host {self.host!r} is not loopback; a run-owned server listens on"
                             f" {LOOPBACK} only")

    @property
    def url(self) -> str:
        if self._socket is None:
            raise RuntimeError(f"{self.name} is not started")
        return f"http://{self.host}:{self._socket.getsockname()[1]}"

    async def start(self) -> str:
        """Listen and serve on the running loop; returns the base URL."""
        try:
            from aiohttp import web
        except ImportError:
            raise ImportError(f"{self.name} needs aiohttp: pip install 'slime-rl-core[gateway]'") from None
        app = web.Application(middlewares=[self._check_key], client_max_size=64 * 2**20)
        for method, path, handler in self.routes:
            app.router.add_route(method, path, handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        sock = listening_socket(self.host, self.port)
        try:
            await web.SockSite(runner, sock).start()
        except BaseException:
            sock.close()
            await runner.cleanup()
            raise
        self._runner, self._socket = runner, sock
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._socket is not None:
            self._socket.close()
        self._runner = self._socket = None

    @property
    def _check_key(self) -> Any:
        from aiohttp import web

        @web.middleware
        async def check_key(request: Any, handler: Handler) -> Any:
            if request.path in self.open_paths:
                return await handler(request)
            expected = self.key_for(request)
            given = presented_key(request.headers)
            if expected is None or given is None or not hmac.compare_digest(given.encode(), expected.encode()):
                what = "no key was given" if given is None else "the key is not this server's key for this path"
                return web.json_response(error_body(
                    f"{self.name}: {what}; send Authorization: Bearer <the key the run gave>",
                    "invalid_request_error", "invalid_api_key"), status=401)
            return await handler(request)

        return check_key
