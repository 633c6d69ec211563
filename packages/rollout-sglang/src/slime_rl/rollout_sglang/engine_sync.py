"""The weight-sync half of `SGLangEngine` (mixed in; its attributes are the engine's): a sync from buckets
in this process (`update_weights`) or pushed by trainer rank 0 between `begin_weight_sync` and
`end_weight_sync`; full weights (pause only when requests are out, flush, continue) or, with LoRA, a new
adapter beside the serving one (adapter_roster.py)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import torch

from slime_rl.core.contracts import NamedTensors
from slime_rl.core.weights.sync import resolve_transport
from slime_rl.rollout_sglang import adapters
from slime_rl.rollout_sglang import weight_sync as ws

logger = logging.getLogger("slime_rl.rollout_sglang.engine")  # the engine's log, as before the split


class EngineWeightSync:
    """`SGLangEngine`'s weight syncs."""

    async def update_weights(self, named_tensors: NamedTensors, *, version: int, last: bool) -> None:
        """One bucket of a sync, from tensors in this process. The first bucket of a version pauses
        generation; the last flushes the prefix cache, (optionally) checks the weights and lets
        generation continue on ``version``."""
        if self._syncing is None:
            on_cuda = any(t.is_cuda for _, t in named_tensors)
            await self.begin_weight_sync(version, transport=resolve_transport(self.transport, colocated=self.colocated,
                                                                              on_cuda=on_cuda))
        elif version != self._syncing:
            raise ws.WeightSyncError(f"weight sync v{self._syncing} is unfinished (no bucket with last=True) "
                                     f"and a bucket for v{version} arrived")
        if self.roster is not None:
            return await self._update_adapter(named_tensors, version=version, last=last)
        step = f"weight sync v{version} bucket {self._bucket_index} ({self._sync_transport})"
        try:
            copied = self._keep_copy(named_tensors) if self._sync_transport != "disk" else None
            await self._send_bucket(named_tensors, version=version, last=last, step=step)
            if copied is not None:
                copied.synchronize()  # the device-to-host copies ran while the engines loaded the bucket
            if self.verify_weights:
                self._verify_sample.update(ws.check_sample(named_tensors, tp_size=ws.widest_tp(self.targets())))
            self._bucket_index += 1
        except BaseException:
            # Partly loaded weights must not serve requests: generation stays held until a full sync.
            self._end_sync(reopen=False)
            raise
        if last:
            await self.end_weight_sync(version)

    def _keep_copy(self, named_tensors: NamedTensors) -> torch.cuda.Event | None:
        """Start copying a bucket into ``_weights_cpu`` when recovery copies are kept (see
        ``keep_weights_for_recovery``): CUDA tensors go without blocking into pinned host buffers reused
        from sync to sync; the returned event marks their end."""
        on_cuda = any(t.is_cuda for _, t in named_tensors)
        keep = self.keep_weights_for_recovery
        if not (keep if keep is not None else not on_cuda):
            return None
        for name, tensor in named_tensors:
            held = self._weights_cpu.get(name)
            if not tensor.is_cuda:
                self._weights_cpu[name] = tensor.detach().to("cpu", copy=True)
                continue
            if held is None or held.shape != tensor.shape or held.dtype != tensor.dtype or not held.is_pinned():
                held = self._weights_cpu[name] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            held.copy_(tensor.detach(), non_blocking=True)
        if not on_cuda:
            return None
        done = torch.cuda.Event()
        done.record()
        return done

    async def begin_weight_sync(self, version: int, *, transport: str = "tensor") -> list[ws.Target]:
        """Hold generation and pause the engines for a sync. `update_weights` calls it; a trainer
        process that pushes the buckets itself (its CUDA tensors are not here) calls it through the
        rollout process, sends with the `weight_sync` functions to the returned targets, then calls
        `end_weight_sync`."""
        self._start_monitor()
        if self._shut:
            raise RuntimeError("SGLangEngine is shut down")
        if self._syncing is not None:
            raise ws.WeightSyncError(f"weight sync v{self._syncing} is unfinished and v{version} began")
        await self._lock().acquire()  # held until the sync ends: a restarted engine waits for its result
        self._syncing, self._bucket_index, self._sync_transport = version, 0, transport
        self._verify_sample = {}
        if self.roster is not None:  # the new adapter loads beside the one requests are using: no pause
            return self.targets()
        self._closed_by.add("sync")
        self._pause_epoch += 1
        if not self._inflight:
            # No request out (the synchronous loop's syncs): the closed gate holds new ones here, so the
            # servers need no pause (nor a continue after; two round trips, ~0.07 s of a 7B sync on an H200)
            return self.targets()
        self._servers_paused = True
        try:
            await self._control_live(ws.pause_generation, timeout=self.sync_timeout,
                                     step=f"weight sync v{version}: pause generation", mode=self.pause_mode)
        except BaseException:
            self._end_sync()  # nothing changed yet: let the engines that did pause go on
            await self._control(_try, ws.continue_generation, self.targets(), timeout=30.0, step="undo pause")
            self._servers_paused = False
            raise
        return self.targets()

    async def end_weight_sync(self, version: int, *, hf_folder: str | Path | None = None) -> None:
        """Flush the prefix cache (its KV came from the old weights), check the weights when asked,
        and let generation continue on ``version``. After an external sync, ``hf_folder`` (an HF
        folder holding this version) is what a restarted engine is restored from."""
        if self._syncing != version:
            raise ws.WeightSyncError(f"end of weight sync v{version}, but the sync in progress is {self._syncing}")
        if self.roster is not None:
            await self._switch_adapter(version)
            return
        step = f"weight sync v{version}"
        try:
            if self._verify_sample:
                for target in self.targets():
                    await self._control(ws.check_weights, target, self._verify_sample,
                                        timeout=self.sync_timeout, step=step)
            held_in_place = self._servers_paused and self.pause_mode == "in_place"
            if not held_in_place:  # SGLang refuses a flush while requests are held in place
                await self._control_live(ws.flush_cache, timeout=self.sync_timeout, step=f"{step}: flush cache")
            if self._servers_paused and "memory" not in self._closed_by:
                await self._control_live(ws.continue_generation, timeout=self.sync_timeout,
                                         step=f"{step}: continue generation")
                self._servers_paused = False
        except BaseException:
            self._end_sync(reopen=False)
            raise
        if hf_folder is not None:
            self._disk_folder, self._sync_transport = Path(hf_folder), "disk"
        elif self._sync_transport == "disk" and self._pusher.folder(version).is_dir():
            self._disk_folder = self._pusher.folder(version)  # the trainer's sender wrote it (same folder rule)
        self._version = version
        self._weights_stale = False
        self._pushed_by_trainer = self._bucket_index == 0  # no bucket came through update_weights
        self._end_sync()

    async def _send_bucket(self, named_tensors: NamedTensors, *, version: int, last: bool, step: str) -> None:
        await self._control(self._pusher.push, self._sync_transport, self.targets(), named_tensors, version=version,
                            index=self._bucket_index, last=last, step=step)
        if last and self._sync_transport == "disk":
            self._disk_folder = self._pusher.folder(version)

    async def _update_adapter(self, named_tensors: NamedTensors, *, version: int, last: bool) -> None:
        """A bucket of adapter tensors: gathered until the last, then loaded into every server as one
        adapter (a failed load leaves the current adapter serving, and raises naming server and adapter)."""
        try:
            adapters.check_adapter_tensors(named_tensors, version=version)
            self.roster.pending.append(named_tensors)
            if last:
                await self._control(self.roster.push, self._sync_transport, self.targets(), version,
                                    base_model=self.model_path, timeout=self.sync_timeout)
        except BaseException:
            self.roster.pending = []
            self._end_sync()
            raise
        if last:
            await self.end_weight_sync(version)

    async def _switch_adapter(self, version: int) -> None:
        """Requests from now on name version ``version``'s adapter; retired ones that no request names go
        (awaited here: a caller's event loop may end with this call)."""
        self._version = version
        try:
            for name in self.roster.switch(version):
                await self._retire_adapter(name)
        finally:
            self._end_sync()

    def _release_adapter(self, name: str | None) -> None:
        if self.roster is not None and self.roster.release(name):
            task = asyncio.get_running_loop().create_task(self._retire_adapter(name))  # the caller: a request
            self._unloads.add(task)
            task.add_done_callback(self._unloads.discard)

    async def _retire_adapter(self, name: str) -> None:
        """A retired adapter off every server (a control thread), then out of the roster (here, on the loop
        that owns it). An unload that did not run (its event loop ended first) is tried again at the next sync."""
        self.roster.unloading.add(name)
        try:
            await self._control(self.roster.unload, self.targets(), name, timeout=self.sync_timeout)
        except BaseException:
            self.roster.unloading.discard(name)
            raise
        self.roster.forget(name)

    def _end_sync(self, reopen: bool = True) -> None:
        self._syncing = None
        if reopen:
            self._closed_by.discard("sync")
        if self._sync_lock is not None and self._sync_lock.locked():
            self._sync_lock.release()


def _try(fn, *args, **kwargs) -> None:
    """Best effort, for clean-up after an error that is already being raised."""
    try:
        fn(*args, **kwargs)
    except Exception as err:
        logger.warning("%s failed during clean-up: %s", getattr(fn, "__name__", fn), err)
