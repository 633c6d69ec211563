"""The run's control endpoint (rollout.elastic.enabled): engines added, removed and listed while a run goes.

It is the run-owned loopback server of infra/keyed_server.py (the agent gateway's kind), started on the
rollout worker's event loop beside the `EnginePool` it drives. Its key derives from the run's key
(``rollout.gateway.api_key``; a fresh one when unset) under the name ``control``, so an agent's episode key
never opens it. ``control.json`` (0600, in the run's log folder) holds the URL and the key for
``slime-cli engines``. Routes: ``GET /engines`` (each engine's name, state, version, requests in flight),
``POST /engines/add`` ``{"count": n}``, ``POST /engines/remove`` ``{"name": "engine-1"}``.

`NodeWatch` (rollout.elastic.grow_on_new_nodes) reports the GPU nodes Ray gained since the last look.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slime_rl.core.infra.keyed_server import KeyedLoopbackServer, derived_key, error_body, new_key
from slime_rl.core.run.engine_pool import EnginePool

CONTROL_FILE = "control.json"
logger = logging.getLogger(__name__)


class ControlEndpoint:
    """``pool``'s add/remove/list on loopback behind ``key``; `start` on the loop the pool runs on."""

    def __init__(self, pool: EnginePool, *, run_key: str | None, folder: str | Path | None):
        self.pool = pool
        self.key = derived_key(run_key, "control") if run_key else new_key()
        self.folder = Path(folder) if folder is not None else None
        self.server = KeyedLoopbackServer(
            routes=[("GET", "/engines", self._list), ("POST", "/engines/add", self._add),
                    ("POST", "/engines/remove", self._remove)],
            key_for=lambda request: self.key, name="the run's control endpoint")

    async def start(self) -> str:
        url = await self.server.start()
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            path = self.folder / CONTROL_FILE
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # the key: the user's only
            with os.fdopen(fd, "w") as out:
                json.dump({"url": url, "key": self.key}, out)
        return url

    async def stop(self) -> None:
        await self.server.stop()
        if self.folder is not None:
            (self.folder / CONTROL_FILE).unlink(missing_ok=True)

    async def _list(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"engines": self.pool.placement()})

    async def _add(self, request: Any) -> Any:
        from aiohttp import web

        body = await _json(request)
        count = body.get("count", 1)
        if not isinstance(count, int) or isinstance(count, bool):
            return web.json_response(error_body("count: give a whole number of engines to add",
                                                "invalid_request_error", param="count"), status=400)
        try:
            names = await self.pool.add_engines(count)
        except ValueError as err:
            return web.json_response(error_body(str(err), "invalid_request_error", param="count"), status=400)
        return web.json_response({"added": names, "engines": self.pool.placement()})

    async def _remove(self, request: Any) -> Any:
        from aiohttp import web

        name = (await _json(request)).get("name")
        try:
            moved = await self.pool.remove_engine(str(name))
        except KeyError as err:
            return web.json_response(error_body(err.args[0], "invalid_request_error", param="name"), status=404)
        except ValueError as err:
            return web.json_response(error_body(str(err), "invalid_request_error", param="name"), status=409)
        return web.json_response({"removed": name, "requests_moved": moved, "engines": self.pool.placement()})


async def _json(request: Any) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def read_control_file(folder: str | Path) -> tuple[str, str]:
    """(url, key) of a running run's control endpoint, from its log folder."""
    path = Path(folder) / CONTROL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no control endpoint; is the run going, with rollout.elastic.enabled=true?")
    data = json.loads(path.read_text())
    return data["url"], data["key"]


class NodeWatch:
    """The GPU nodes Ray gained since the last `new_nodes` (``nodes``: `ray.nodes`, or a test's list)."""

    def __init__(self, nodes: Callable[[], list[dict[str, Any]]]):
        self.nodes = nodes
        self.seen = self._gpu_nodes()

    def _gpu_nodes(self) -> set[str]:
        return {n["NodeID"] for n in self.nodes() if n.get("Alive") and n.get("Resources", {}).get("GPU", 0) > 0}

    def new_nodes(self) -> list[str]:
        now = self._gpu_nodes()
        new, self.seen = sorted(now - self.seen), now
        return new


async def grow_on_new_nodes(pool: EnginePool, watch: NodeWatch, every_s: float = 10.0) -> None:
    """rollout.elastic.grow_on_new_nodes: one engine more for each GPU node Ray gains (until max_engines)."""
    while True:
        await asyncio.sleep(every_s)
        new = await asyncio.to_thread(watch.new_nodes)
        for node in new:
            try:
                names = await pool.add_engines(1)
            except ValueError as err:  # at max_engines: say so once per node, keep watching
                logger.warning("elastic: GPU node %s joined; no engine added: %s", node, err)
                continue
            logger.info("elastic: GPU node %s joined; added %s", node, ", ".join(names))
