"""A dying SGLang server does not end the run: the monitor health-checks the servers; a dead one is
taken out of the router, restarted (or, when attached, waited for), given the current weights and
registered again (`rollout.sglang.max_engine_restarts` times in a row at most), with its LoRA adapters when the run
syncs adapters. `EngineRecovery`, which `SGLangEngine` holds and delegates to."""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from slime_rl.rollout_sglang.control import ServerControl, server_target
from slime_rl.rollout_sglang.hold import GenerationHold
from slime_rl.rollout_sglang.router import Router
from slime_rl.rollout_sglang.server import ServerStartError, SGLangServer, restart_server, wait_healthy
from slime_rl.rollout_sglang.weights import server_api
from slime_rl.rollout_sglang.weights.engine_sync import EngineWeightSync
from slime_rl.rollout_sglang.weights.server_api import WeightSyncError

logger = logging.getLogger("slime_rl.rollout_sglang.engine")  # the engine's log


class EngineRecovery:
    """The monitor (every ``health_interval`` s; 0: none) and the restart of a dead server: ``control``'s servers
    (a restarted one takes its dead one's place there), taken out of ``router`` and back, up to
    ``startup_timeout`` for ``/health``, the current weights from ``weights``, the hold re-applied from ``hold``.
    ``max_recovery_attempts`` (rollout.sglang.max_engine_restarts) failed restarts in a row give an engine up."""

    def __init__(self, *, control: ServerControl, router: Router, weights: EngineWeightSync, hold: GenerationHold,
                 startup_timeout: float, health_interval: float, max_recovery_attempts: int = 3):
        self.control, self.router, self.weights, self.hold = control, router, weights, hold
        self.startup_timeout = startup_timeout  # a restarted server until /health
        self.health_interval = health_interval
        self.max_recovery_attempts = max_recovery_attempts
        self.restarts = 0  # engines restarted after a failure (a metric)
        self._failures: dict[int, int] = {}  # consecutive failed health checks per engine
        self._recovery_failures: dict[int, int] = {}
        self._monitor_task: asyncio.Task | None = None

    def start_monitor(self) -> None:
        """The monitor on the running event loop, unless it runs there already (or ``health_interval`` is 0)."""
        loop = asyncio.get_running_loop()
        task = self._monitor_task
        if self.health_interval > 0 and (task is None or task.done() or task.get_loop() is not loop):
            self._monitor_task = loop.create_task(self._monitor())

    def stop_monitor(self) -> None:
        if self._monitor_task is not None and not self._monitor_task.done():
            self._monitor_task.cancel()

    def describe_servers(self) -> str:
        def status(s: SGLangServer) -> str:
            if s.index in self.control.recovering:
                return "restarting"
            if s.process is not None and not s.process.alive():
                return "dead"
            return "given up on" if self._recovery_failures.get(s.index, 0) >= self.max_recovery_attempts else "up"

        return ", ".join(f"{s.name} {status(s)}" for s in self.control.servers)

    def restarting(self) -> bool:
        """An engine is down and coming back (being restarted, or its process gone and not noticed yet):
        requests wait for it rather than count against rollout.sglang.generate_max_retries."""
        return bool(self.control.recovering) or any(s.process is not None and not s.process.alive()
                                                    for s in self.control.servers)

    async def _monitor(self) -> None:
        # One aiohttp session for every check, all servers at once (docs/scale.md): a fresh httpx client per check,
        # one server after another, cost 0.43 s of CPU per 10 s at 8 idle servers; one httpx client for all, 4 ms
        # a check at 128 servers (its pool is quadratic in concurrent requests); aiohttp, 0.07 ms.
        # force_close: a new connection a check, so a dead server's refusal shows at its first check (a kept-alive
        # connection to it fails as a disconnect instead, which counts as one failure of three)
        timeout = aiohttp.ClientTimeout(total=5.0)
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
            while not self.hold.shut:
                await asyncio.sleep(self.health_interval)
                servers = [s for s in list(self.control.servers) if s.index not in self.control.recovering
                           and self._recovery_failures.get(s.index, 0) < self.max_recovery_attempts]
                dead = await asyncio.gather(*(self._is_dead(s, http=http) for s in servers))
                for server, is_dead in zip(servers, dead, strict=True):
                    if is_dead and not self.hold.shut and server.index not in self.control.recovering:
                        self.control.recovering.add(server.index)
                        asyncio.get_running_loop().create_task(self._recover(server))

    async def _is_dead(self, server: SGLangServer, http: aiohttp.ClientSession, failures_allowed: int = 3) -> bool:
        if server.process is not None and not server.process.alive():
            return True
        try:
            async with http.get(f"{server.url}/health") as resp:
                ok = resp.status == 200
        except aiohttp.ClientConnectorError:
            # Nothing listens on its port: the server is gone (a busy one answers late, not never). Waiting for three
            # checks 5 s apart missed a server restarted within them (by its supervisor, attached), which then served
            # the model's first weights until the next sync (the scale simulation, docs/scale.md).
            self._failures[server.index] = failures_allowed
            return True
        except (TimeoutError, aiohttp.ClientError):
            ok = False
        self._failures[server.index] = 0 if ok else self._failures.get(server.index, 0) + 1
        return self._failures[server.index] >= failures_allowed

    async def _recover(self, server: SGLangServer) -> None:
        """Out of the router, restarted (or waited for), current weights in, back in the router."""
        idx = server.index
        if self._recovery_failures.get(idx, 0) >= self.max_recovery_attempts:
            self.control.recovering.discard(idx)
            return  # given up on (logged below); health() reports False
        control, weights, hold = self.control, self.weights, self.hold
        fresh = server
        try:
            logger.warning("%s failed; taking it out of the router and restarting it", server.name)
            await control.run(self.router.remove_worker, server.url)
            # members changed: the weight-update group is made anew at the next sync
            await control.run(weights.pusher.drop_group, control.targets())
            if server.process is not None:
                fresh = await control.run(restart_server, server)
            await control.run(wait_healthy, fresh, self.startup_timeout)
            if hold.shut:
                raise RuntimeError("the engine shut down during recovery")
            async with weights.lock():  # a sync in progress ends first; then this engine gets its version
                target = server_target(fresh)
                if (weights.version > 0 and weights.roster is None) or hold.weights_stale:
                    await control.run(weights.restore, [target])
                if weights.roster is not None:
                    await control.run(weights.roster.reload, target, weights.roster.loaded(), timeout=weights.timeout)
                if hold.released:  # a colocated trainer holds the GPU now: give the memory back again
                    await control.run(server_api.release_memory, [target], sorted(hold.released),
                                      timeout=weights.timeout)
                if hold.closed_by:
                    hold.servers_paused = True
                    await control.run(server_api.pause_generation, [target], timeout=weights.timeout,
                                      step="recovery: hold generation")
                control.servers[control.servers.index(server)] = fresh
                self._failures[idx] = 0
                await control.run(self.router.add_worker, fresh.url, api_key=fresh.keys.api_key)
            self.restarts += 1
            self._recovery_failures[idx] = 0
            logger.warning("%s is back with weight version %d", fresh.name, weights.version)
        except (ServerStartError, WeightSyncError, OSError, RuntimeError) as err:
            self._recovery_failures[idx] = self._recovery_failures.get(idx, 0) + 1
            if fresh is not server and fresh.process is not None:
                fresh.process.stop()  # never left running outside the engine's list
            left = self.max_recovery_attempts - self._recovery_failures[idx]
            logger.error("recovery of %s failed (%s); %s", server.name, err,
                         f"{left} more attempts" if left > 0 else "giving up on this engine")
        finally:
            control.recovering.discard(idx)

    async def health(self) -> bool:
        """True when every server answers ``/health`` and none is being restarted."""
        if self.control.recovering or any(n >= self.max_recovery_attempts for n in self._recovery_failures.values()):
            return False
        async def status(http: aiohttp.ClientSession, url: str) -> int:
            async with http.get(f"{url}/health") as resp:
                return resp.status

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0),
                                         connector=aiohttp.TCPConnector(limit=0)) as http:
            results = await asyncio.gather(*(status(http, s.url) for s in self.control.servers),
                                           return_exceptions=True)
        return all(r == 200 for r in results)
