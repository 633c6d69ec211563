"""The engine side of a weight sync: `EngineWeightSync`, which `SGLangEngine` holds and delegates to. A sync
comes from buckets in this process (`update_weights`) or is pushed by trainer rank 0 (trainer_sender.py)
between `begin_weight_sync` and `end_weight_sync`; full weights (pause only when requests are out, flush,
continue) or, with LoRA, a new adapter beside the serving one (adapter_roster.py). It also keeps what a
restarted server is restored to (`restore`): the model, the last disk folder, the trainer's restore copy
(restore_copy.py) or a host copy of the last engine-side sync."""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from slime_rl.core.contracts import NamedTensors
from slime_rl.core.weights.fp8 import FP8Format, quantize_named
from slime_rl.core.weights.sync import resolve_transport
from slime_rl.rollout_sglang.control import ServerControl
from slime_rl.rollout_sglang.hold import GenerationHold
from slime_rl.rollout_sglang.weights import adapters, disk, server_api, verify
from slime_rl.rollout_sglang.weights.adapter_roster import AdapterRoster
from slime_rl.rollout_sglang.weights.pusher import BucketPusher
from slime_rl.rollout_sglang.weights.restore_copy import wait_for_version
from slime_rl.rollout_sglang.weights.server_api import Target, WeightSyncError

logger = logging.getLogger("slime_rl.rollout_sglang.engine")  # the engine's log


class EngineWeightSync:
    """The weight version the servers serve and how it got there. ``transport`` (``auto`` resolved per sync by
    `resolve_transport`) and ``colocated`` choose the way in; ``roster`` (trainer.lora with
    rollout.lora_sync=adapter) makes syncs load adapters; ``requests_out`` says whether requests are at the
    servers (a sync pauses only then). Tunables: ``verify_weights`` (compare engine and trainer weights after
    each sync), ``keep_weights_for_recovery`` (a host copy of each engine-side sync: None, only when the buckets
    are already on the CPU; copying CUDA buckets to the host cost ~10 s per 7B sync, issue 16), ``pause_mode``
    (``in_place`` under cluster.async_mode=fully: running requests wait in place; not verified on a GPU yet)."""

    def __init__(self, *, control: ServerControl, hold: GenerationHold, pusher: BucketPusher, model_path: str,
                 transport: str, colocated: bool, roster: AdapterRoster | None, requests_out: Callable[[], bool],
                 keep_weights_for_recovery: bool | None = None, verify_weights: bool = False):
        self.control, self.hold, self.pusher = control, hold, pusher
        self.model_path = model_path
        self.transport, self.colocated = transport, colocated
        self.roster = roster
        self.keep_weights_for_recovery = keep_weights_for_recovery
        self.verify_weights = verify_weights
        self.pause_mode = "abort"
        self.fp8: FP8Format | None = None  # rollout.precision=fp8: the format buckets are quantised to (fp8.py)
        self.version = 0
        self.unloads: set[asyncio.Task] = set()  # retired adapters leaving the servers
        self._requests_out = requests_out
        self._syncing: int | None = None  # the version whose buckets are arriving
        self._bucket_index = 0
        self._sync_transport: str | None = None
        self._sync_lock: asyncio.Lock | None = None
        self._lock_loop: asyncio.AbstractEventLoop | None = None
        self._weights_cpu: dict[str, torch.Tensor] = {}
        self._verify_sample: dict[str, str] = {}  # name -> checksum
        self._disk_folder: Path | None = None  # the HF folder of the current version (disk transport)
        self._restore_folder: tuple[int, Path] | None = None
        self._pushed_by_trainer = False  # the last sync came from the trainer's sender (begin/end_weight_sync)

    @property
    def timeout(self) -> float:
        """One transfer step (one bucket into one engine, a pause, a flush)."""
        return self.pusher.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self.pusher.timeout = seconds

    def lock(self) -> asyncio.Lock:
        """Held through a sync: a restarted engine or a restore of stale weights waits for its result."""
        loop = asyncio.get_running_loop()
        if self._sync_lock is None or self._lock_loop is not loop:
            self._sync_lock, self._lock_loop = asyncio.Lock(), loop
        return self._sync_lock

    # ------------------------------------------------------------------ a sync

    async def update_weights(self, named_tensors: NamedTensors, *, version: int, last: bool) -> None:
        """One bucket of a sync, from tensors in this process. The first bucket of a version pauses
        generation; the last flushes the prefix cache, (optionally) checks the weights and lets
        generation continue on ``version``."""
        if self._syncing is None:
            on_cuda = any(t.is_cuda for _, t in named_tensors)
            await self.begin_weight_sync(version, transport=resolve_transport(self.transport, colocated=self.colocated,
                                                                              on_cuda=on_cuda))
        elif version != self._syncing:
            raise WeightSyncError(f"weight sync v{self._syncing} is unfinished (no bucket with last=True) "
                                  f"and a bucket for v{version} arrived")
        if self.roster is not None:
            return await self._update_adapter(named_tensors, version=version, last=last)
        if self.fp8 is not None:  # FP8 engines load (weight, scale) pairs (docs/fp8.md); quantised where the tensors are
            named_tensors = quantize_named(named_tensors, self.fp8)
        step = f"weight sync v{version} bucket {self._bucket_index} ({self._sync_transport})"
        try:
            copied = self._keep_copy(named_tensors) if self._sync_transport != "disk" else None
            await self._send_bucket(named_tensors, version=version, last=last, step=step)
            if copied is not None:
                copied.synchronize()  # the device-to-host copies ran while the engines loaded the bucket
            if self.verify_weights:
                self._verify_sample.update(verify.check_sample(named_tensors,
                                                               tp_size=verify.widest_tp(self.control.targets())))
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

    async def begin_weight_sync(self, version: int, *, transport: str = "tensor") -> list[Target]:
        """Hold generation and pause the engines for a sync. `update_weights` calls it; a trainer
        process that pushes the buckets itself (its CUDA tensors are not here) calls it through the
        rollout process, sends with the transports (pusher.py) to the returned targets, then calls
        `end_weight_sync`."""
        if self.hold.shut:
            raise RuntimeError("SGLangEngine is shut down")
        if self._syncing is not None:
            raise WeightSyncError(f"weight sync v{self._syncing} is unfinished and v{version} began")
        await self.lock().acquire()  # held until the sync ends: a restarted engine waits for its result
        self._syncing, self._bucket_index, self._sync_transport = version, 0, transport
        self._verify_sample = {}
        if self.roster is not None:  # the new adapter loads beside the one requests are using: no pause
            return self.control.targets()
        self.hold.close("sync")
        if not self._requests_out():
            # No request out (the synchronous loop's syncs): the closed gate holds new ones here, so the
            # servers need no pause (nor a continue after; two round trips, ~0.07 s of a 7B sync on an H200)
            return self.control.targets()
        self.hold.servers_paused = True
        try:
            await self.control.run_live(server_api.pause_generation, timeout=self.timeout,
                                        step=f"weight sync v{version}: pause generation", mode=self.pause_mode)
        except BaseException:
            self._end_sync()  # nothing changed yet: let the engines that did pause go on
            await self.control.run(_try, server_api.continue_generation, self.control.targets(), timeout=30.0,
                                   step="undo pause")
            self.hold.servers_paused = False
            raise
        return self.control.targets()

    async def end_weight_sync(self, version: int, *, hf_folder: str | Path | None = None) -> None:
        """Flush the prefix cache (its KV came from the old weights), check the weights when asked,
        and let generation continue on ``version``. After an external sync, ``hf_folder`` (an HF
        folder holding this version) is what a restarted engine is restored from."""
        if self._syncing != version:
            raise WeightSyncError(f"end of weight sync v{version}, but the sync in progress is {self._syncing}")
        if self.roster is not None:
            await self._switch_adapter(version)
            return
        step = f"weight sync v{version}"
        hold = self.hold
        try:
            if self._verify_sample:
                for target in self.control.targets():
                    await self.control.run(verify.check_weights, target, self._verify_sample,
                                           timeout=self.timeout, step=step)
            held_in_place = hold.servers_paused and self.pause_mode == "in_place"
            if not held_in_place:  # SGLang refuses a flush while requests are held in place
                await self.control.run_live(server_api.flush_cache, timeout=self.timeout,
                                            step=f"{step}: flush cache")
            if hold.servers_paused and "memory" not in hold.closed_by:
                await self.control.run_live(server_api.continue_generation, timeout=self.timeout,
                                            step=f"{step}: continue generation")
                hold.servers_paused = False
        except BaseException:
            self._end_sync(reopen=False)
            raise
        if hf_folder is not None:
            self._disk_folder, self._sync_transport = Path(hf_folder), "disk"
        elif self._sync_transport == "disk" and self.pusher.folder(version).is_dir():
            self._disk_folder = self.pusher.folder(version)  # the trainer's sender wrote it (same folder rule)
        self.version = version
        hold.weights_stale = False
        self._pushed_by_trainer = self._bucket_index == 0  # no bucket came through update_weights
        self._end_sync()

    async def _send_bucket(self, named_tensors: NamedTensors, *, version: int, last: bool, step: str) -> None:
        await self.control.run(self.pusher.push, self._sync_transport, self.control.targets(), named_tensors,
                               version=version, index=self._bucket_index, last=last, step=step)
        if last and self._sync_transport == "disk":
            self._disk_folder = self.pusher.folder(version)

    def _end_sync(self, reopen: bool = True) -> None:
        self._syncing = None
        if reopen:
            self.hold.closed_by.discard("sync")
        if self._sync_lock is not None and self._sync_lock.locked():
            self._sync_lock.release()

    # ------------------------------------------------------------------ LoRA adapters

    async def _update_adapter(self, named_tensors: NamedTensors, *, version: int, last: bool) -> None:
        """A bucket of adapter tensors: gathered until the last, then loaded into every server as one
        adapter (a failed load leaves the current adapter serving, and raises naming server and adapter)."""
        try:
            adapters.check_adapter_tensors(named_tensors, version=version)
            self.roster.pending.append(named_tensors)
            if last:
                await self.control.run(self.roster.push, self._sync_transport, self.control.targets(), version,
                                       base_model=self.model_path, timeout=self.timeout)
        except BaseException:
            self.roster.pending = []
            self._end_sync()
            raise
        if last:
            await self.end_weight_sync(version)

    async def _switch_adapter(self, version: int) -> None:
        """Requests from now on name version ``version``'s adapter; retired ones that no request names go
        (awaited here: a caller's event loop may end with this call)."""
        self.version = version
        try:
            for name in self.roster.switch(version):
                await self._retire_adapter(name)
        finally:
            self._end_sync()

    def release_adapter(self, name: str | None) -> None:
        """A request that named adapter ``name`` (None: the base model) came back; the last one of a retired
        adapter takes it off the servers."""
        if self.roster is not None and self.roster.release(name):
            task = asyncio.get_running_loop().create_task(self._retire_adapter(name))  # the caller: a request
            self.unloads.add(task)
            task.add_done_callback(self.unloads.discard)

    async def _retire_adapter(self, name: str) -> None:
        """A retired adapter off every server (a control thread), then out of the roster (here, on the loop
        that owns it). An unload that did not run (its event loop ended first) is tried again at the next sync."""
        self.roster.unloading.add(name)
        try:
            await self.control.run(self.roster.unload, self.control.targets(), name, timeout=self.timeout)
        except BaseException:
            self.roster.unloading.discard(name)
            raise
        self.roster.forget(name)

    # ------------------------------------------------------------------ restore

    def restore_folder(self) -> Path:
        """An HF folder holding the current version: the model itself, the last disk sync, or the
        CPU copy of the last tensor/NCCL sync written out once."""
        if self.version == 0 or self.roster is not None:  # adapters leave the base weights as they were
            return Path(self.model_path)
        if self._disk_folder is not None and self._sync_transport in (None, "disk"):
            return self._disk_folder
        if self._restore_folder is not None and self._restore_folder[0] == self.version:
            return self._restore_folder[1]
        weights_dir = self.pusher.weights_dir
        if self._pushed_by_trainer:  # the trainer's sender writes the copy (restore_copy.py), maybe still
            folder = wait_for_version(weights_dir, self.version, self.timeout)
            if folder is not None:
                return folder
        if self._pushed_by_trainer or not self._weights_cpu:
            raise WeightSyncError(
                f"cannot restore weight version {self.version}: no copy was kept (the trainer's sender writes one"
                f" under {weights_dir}/restore unless rollout.sglang.max_engine_restarts=0; an engine-side sync"
                " keeps one with SGLangEngine.keep_weights_for_recovery)")
        folder = weights_dir / f"restore-v{self.version}"
        shutil.rmtree(folder, ignore_errors=True)
        disk.save_hf_folder(list(self._weights_cpu.items()), folder, self.model_path)
        if self._restore_folder is not None:
            shutil.rmtree(self._restore_folder[1], ignore_errors=True)
        self._restore_folder = (self.version, folder)
        return folder

    def restore(self, targets: list[Target]) -> None:
        """The current version into ``targets`` from `restore_folder` (blocking: a control thread)."""
        folder = self.restore_folder()
        for target in targets:
            disk.update_from_disk(target, folder, version=self.version, timeout=self.timeout,
                                  step=f"restore weight version {self.version}")
        server_api.flush_cache(targets, timeout=self.timeout, step="restore: flush cache")

    async def restore_stale(self) -> None:
        """The current version back into every server after a memory release without a CPU backup."""
        async with self.lock():
            if self.hold.weights_stale:
                await self.control.run(self.restore, self.control.targets())
                self.hold.weights_stale = False


def _try(fn, *args, **kwargs) -> None:
    """Best effort, for clean-up after an error that is already being raised."""
    try:
        fn(*args, **kwargs)
    except Exception as err:
        logger.warning("%s failed during clean-up: %s", getattr(fn, "__name__", fn), err)
