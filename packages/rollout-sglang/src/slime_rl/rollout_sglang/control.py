"""`SGLangEngine`'s servers as its control calls (weight sync, memory, recovery) see them: which take part
now, and threads of the engine's own to block on while a call runs (weights/server_api.py has the calls)."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from slime_rl.rollout_sglang.server import SGLangServer
from slime_rl.rollout_sglang.weights.server_api import Target, WeightSyncError

logger = logging.getLogger("slime_rl.rollout_sglang.engine")  # the engine's log

T = TypeVar("T")


def server_target(server: SGLangServer) -> Target:
    """A server as control calls see it; they carry its admin key (the trainer's sender gets these too)."""
    return Target(server.name, server.url, server.tp_size, admin_key=server.keys.admin_key,
                  api_key=server.keys.api_key)


class ServerControl:
    """The servers (the engine's list: recovery puts a restarted one in its dead one's place) and the
    indexes of those being restarted (`EngineRecovery` adds and removes them), which control calls skip.

    Control calls block in threads of their own: asyncio's default executor is shared with whatever else
    runs in this process, and when it is full a weight sync would wait forever. One per server for
    recoveries (each may wait minutes), plus the sync's."""

    def __init__(self, servers: list[SGLangServer]):
        self.servers = servers
        self.recovering: set[int] = set()
        self._threads = ThreadPoolExecutor(len(servers) + 4, thread_name_prefix="sglang-control")

    def targets(self) -> list[Target]:
        """The servers that take part in control calls now: not those being restarted, nor a launched
        one whose process has died (the monitor restarts it and gives it the current weights)."""
        return [server_target(s) for s in self.servers
                if s.index not in self.recovering and (s.process is None or s.process.alive())]

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the engine's own control threads."""
        return await asyncio.get_running_loop().run_in_executor(self._threads, functools.partial(fn, *args, **kwargs))

    async def run_live(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(targets, *args, **kwargs)`` on the live servers; when one dies during the call (its
        process gone), again on those left: the dead one's recovery restores it."""
        while True:
            targets = self.targets()
            try:
                return await self.run(fn, targets, *args, **kwargs)
            except WeightSyncError as err:
                if not await self.run(self.died, targets):
                    raise
                logger.warning("%s: a server died during the call (%s); going on with the others",
                               kwargs.get("step", getattr(fn, "__name__", fn)), err)

    def died(self, targets: list[Target], wait_s: float = 2.0) -> bool:
        """Whether a launched server among ``targets`` has died, waiting ``wait_s`` for it to show: a
        killed server resets its connections before its process is gone."""
        urls = {t.url for t in targets}
        launched = [s for s in self.servers if s.url in urls and s.process is not None]
        deadline = time.monotonic() + wait_s
        while not any(not s.process.alive() for s in launched):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def shutdown(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
