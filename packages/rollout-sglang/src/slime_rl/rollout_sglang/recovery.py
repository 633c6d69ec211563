"""A dying SGLang server does not end the run: the monitor health-checks the servers; a dead one is
taken out of the router, restarted (or, when attached, waited for), given the current weights and
registered again (`rollout.max_engine_restarts` times in a row at most), with its LoRA adapters when the run
syncs adapters. Also the restore of weights a memory release left stale. `SGLangEngine` mixes this in."""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from pathlib import Path

import httpx

from slime_rl.rollout_sglang import weight_sync as ws
from slime_rl.rollout_sglang.restore_copy import wait_for_version
from slime_rl.rollout_sglang.server import ServerStartError, SGLangServer, restart_server, wait_healthy

logger = logging.getLogger("slime_rl.rollout_sglang.engine")  # the engine's log, as before the split


def server_target(server: SGLangServer) -> ws.Target:
    """A server as control calls see it; they carry its admin key (the trainer's sender gets these too)."""
    return ws.Target(server.name, server.url, server.tp_size, admin_key=server.keys.admin_key,
                     api_key=server.keys.api_key)


class EngineRecovery:
    """The monitor and the recovery of `SGLangEngine` (its attributes are the engine's)."""

    def _died(self, targets: list[ws.Target], wait_s: float = 2.0) -> bool:
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

    def _describe_servers(self) -> str:
        def status(s: SGLangServer) -> str:
            if s.index in self._recovering:
                return "restarting"
            if s.process is not None and not s.process.alive():
                return "dead"
            return "given up on" if self._recovery_failures.get(s.index, 0) >= self.max_recovery_attempts else "up"

        return ", ".join(f"{s.name} {status(s)}" for s in self.servers)

    def _restarting(self) -> bool:
        """An engine is down and coming back (being restarted, or its process gone and not noticed yet):
        requests wait for it rather than count against rollout.generate_max_retries."""
        return bool(self._recovering) or any(s.process is not None and not s.process.alive() for s in self.servers)

    def _restore_source(self) -> Path:
        """An HF folder holding the current version: the model itself, the last disk sync, or the
        CPU copy of the last tensor/NCCL sync written out once."""
        if self._version == 0 or self.roster is not None:  # adapters leave the base weights as they were
            return Path(self.model_path)
        if self._disk_folder is not None and self._sync_transport in (None, "disk"):
            return self._disk_folder
        if self._restore_folder is not None and self._restore_folder[0] == self._version:
            return self._restore_folder[1]
        if self._pushed_by_trainer:  # the trainer's sender writes the copy (restore_copy.py), maybe still
            folder = wait_for_version(self._pusher.weights_dir, self._version, self.sync_timeout)
            if folder is not None:
                return folder
        if self._pushed_by_trainer or not self._weights_cpu:
            raise ws.WeightSyncError(
                f"cannot restore weight version {self._version}: no copy was kept (the trainer's sender writes one"
                f" under {self._pusher.weights_dir}/restore unless rollout.max_engine_restarts=0; an engine-side sync"
                " keeps one with SGLangEngine.keep_weights_for_recovery)")
        folder = self.work_dir / "weights" / f"restore-v{self._version}"
        shutil.rmtree(folder, ignore_errors=True)
        ws.save_hf_folder(list(self._weights_cpu.items()), folder, self.model_path)
        if self._restore_folder is not None:
            shutil.rmtree(self._restore_folder[1], ignore_errors=True)
        self._restore_folder = (self._version, folder)
        return folder

    def _restore_weights(self, targets: list[ws.Target]) -> None:
        folder = self._restore_source()
        for target in targets:
            ws.update_from_disk(target, folder, version=self._version, timeout=self.sync_timeout,
                                step=f"restore weight version {self._version}")
        ws.flush_cache(targets, timeout=self.sync_timeout, step="restore: flush cache")

    async def _restore_stale_weights(self) -> None:
        async with self._lock():
            if self._weights_stale:
                await self._control(self._restore_weights, self.targets())
                self._weights_stale = False

    async def _monitor(self) -> None:
        while not self._shut:
            await asyncio.sleep(self.health_interval)
            for server in list(self.servers):
                given_up = self._recovery_failures.get(server.index, 0) >= self.max_recovery_attempts
                if server.index in self._recovering or given_up or self._shut:
                    continue
                if await self._is_dead(server):
                    self._recovering.add(server.index)
                    asyncio.get_running_loop().create_task(self._recover(server))

    async def _is_dead(self, server: SGLangServer, failures_allowed: int = 3) -> bool:
        if server.process is not None and not server.process.alive():
            return True
        try:
            async with httpx.AsyncClient(timeout=5.0) as http:
                ok = (await http.get(f"{server.url}/health")).status_code == 200
        except httpx.HTTPError:
            ok = False
        self._failures[server.index] = 0 if ok else self._failures.get(server.index, 0) + 1
        return self._failures[server.index] >= failures_allowed

    async def _recover(self, server: SGLangServer) -> None:
        """Out of the router, restarted (or waited for), current weights in, back in the router."""
        idx = server.index
        if self._recovery_failures.get(idx, 0) >= self.max_recovery_attempts:
            self._recovering.discard(idx)
            return  # given up on (logged below); health() reports False
        fresh = server
        try:
            logger.warning("%s failed; taking it out of the router and restarting it", server.name)
            await self._control(self.router.remove_worker, server.url)
            await self._control(self._pusher.drop_group, self.targets())  # members changed: made anew at the next sync
            if server.process is not None:
                fresh = await self._control(restart_server, server)
            await self._control(wait_healthy, fresh, self.startup_timeout)
            if self._shut:
                raise RuntimeError("the engine shut down during recovery")
            async with self._lock():  # a sync in progress ends first; then this engine gets its version
                target = server_target(fresh)
                if (self._version > 0 and self.roster is None) or self._weights_stale:
                    await self._control(self._restore_weights, [target])
                if self.roster is not None:
                    await self._control(self.roster.reload, target, self.roster.loaded(), timeout=self.sync_timeout)
                if self._released:  # a colocated trainer holds the GPU now: give the memory back again
                    await self._control(ws.release_memory, [target], sorted(self._released),
                                            timeout=self.sync_timeout)
                if self._closed_by:
                    self._servers_paused = True
                    await self._control(ws.pause_generation, [target], timeout=self.sync_timeout,
                                            step="recovery: hold generation")
                self.servers[self.servers.index(server)] = fresh
                self._failures[idx] = 0
                await self._control(self.router.add_worker, fresh.url, api_key=fresh.keys.api_key)
            self.restarts += 1
            self._recovery_failures[idx] = 0
            logger.warning("%s is back with weight version %d", fresh.name, self._version)
        except (ServerStartError, ws.WeightSyncError, OSError, RuntimeError) as err:
            self._recovery_failures[idx] = self._recovery_failures.get(idx, 0) + 1
            if fresh is not server and fresh.process is not None:
                fresh.process.stop()  # never left running outside the engine's list
            left = self.max_recovery_attempts - self._recovery_failures[idx]
            logger.error("recovery of %s failed (%s); %s", server.name, err,
                         f"{left} more attempts" if left > 0 else "giving up on this engine")
        finally:
            self._recovering.discard(idx)

    async def health(self) -> bool:
        """True when every server answers ``/health`` and none is being restarted."""
        if self._recovering or any(n >= self.max_recovery_attempts for n in self._recovery_failures.values()):
            return False
        async with httpx.AsyncClient(timeout=5.0) as http:
            results = await asyncio.gather(*(http.get(f"{s.url}/health") for s in self.servers),
                                           return_exceptions=True)
        return all(not isinstance(r, BaseException) and r.status_code == 200 for r in results)
