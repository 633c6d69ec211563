"""Which LoRA adapter an `SGLangEngine`'s requests name, and when an old one leaves the servers.

Weight version N is served as adapter ``slime-vN`` (`slime_rl.core.algorithms.lora.adapter_name`); version 0 is
the base model (no adapter). A sync loads the new adapter beside the current one; requests sent from
then on name the new one, and the old one is unloaded from every server once the last request that
named it has come back (counted here, per adapter name, in the client). A restarted server gets every
adapter still in use again from its PEFT folder.
"""

from __future__ import annotations

import logging
import shutil
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from slime_rl.core.algorithms.lora import LoraSpec, adapter_name
from slime_rl.core.contracts import NamedTensors
from slime_rl.rollout_sglang.weights import adapters
from slime_rl.rollout_sglang.weights.background_write import wait_for_folder
from slime_rl.rollout_sglang.weights.server_api import Target, WeightSyncError

logger = logging.getLogger(__name__)


@dataclass
class AdapterRoster:
    """The adapters an engine's servers hold: the current one (requests name it) and retired ones
    (still named by requests in flight). Not thread-safe: the engine's event loop owns it; the blocking
    calls below run on control threads and change none of its state but ``pending``."""

    spec: LoraSpec
    work_dir: Path  # adapter folders live in work_dir/adapters/v{N} (`adapters.adapter_folder`)
    current: str | None = None  # None: the base model
    version: int = 0  # the weight version the current adapter is
    in_flight: Counter[str] = field(default_factory=Counter)  # adapter name -> requests out naming it
    retired: set[str] = field(default_factory=set)  # loaded, no longer current, waiting for in_flight 0
    unloading: set[str] = field(default_factory=set)  # retired ones whose unload is under way
    folders: dict[str, Path] = field(default_factory=dict)  # every loaded adapter's PEFT folder
    pending: list[NamedTensors] = field(default_factory=list)  # buckets of the sync in progress
    writer: adapters.FolderWriter = field(default_factory=adapters.FolderWriter)  # folders of engine-side pushes

    def acquire(self) -> tuple[str | None, int]:
        """The adapter a request about to go out names, and its weight version; counted until `release`."""
        if self.current is not None:
            self.in_flight[self.current] += 1
        return self.current, self.version

    def release(self, name: str | None) -> bool:
        """A request naming ``name`` came back. True when that was the last one of a retired adapter,
        which may be unloaded now."""
        if name is None:
            return False
        self.in_flight[name] -= 1
        if self.in_flight[name] <= 0:
            del self.in_flight[name]
            return name in self.retired
        return False

    def switch(self, version: int) -> list[str]:
        """Version ``version``'s adapter (loaded on every server) becomes the current one. Returns the
        retired adapters no request names, to unload now."""
        name = adapter_name(version)
        self.folders[name] = adapters.adapter_folder(self.work_dir, version)
        if self.current is not None and self.current != name:
            self.retired.add(self.current)
        self.current, self.version = name, version
        return self.drained()

    def drained(self) -> list[str]:
        """Retired adapters no request names and no unload is under way for (one whose unload was lost,
        say with the event loop that ran it, shows up here again)."""
        return sorted(n for n in self.retired if not self.in_flight[n] and n not in self.unloading)

    def loaded(self) -> list[tuple[str, Path]]:
        """The adapters a server must hold now (retired ones first), with their folders."""
        names = sorted(self.retired) + ([self.current] if self.current is not None else [])
        return [(n, self.folders[n]) for n in names]

    # ------------------------------------------------------------------ blocking calls (control threads)

    def push(self, transport: str, targets: list[Target], version: int, *, base_model: str,
             timeout: float) -> None:
        """The buckets gathered for ``version`` into every server (`adapters.push_adapter`; on a failure
        the new adapter is taken off the servers again and the current one stays)."""
        tensors = [item for bucket in self.pending for item in bucket]
        self.pending = []
        adapters.push_adapter(transport, targets, tensors, self.spec, version=version, base_model=base_model,
                              folder=adapters.adapter_folder(self.work_dir, version), timeout=timeout,
                              writer=self.writer)

    def unload(self, targets: list[Target], name: str, *, timeout: float) -> None:
        """``name`` off every server (a control thread; `forget` it after, on the loop). A server that
        refuses is logged (a dead one has nothing to unload; a restarted one is given only the adapters in use)."""
        for target in targets:
            try:
                adapters.unload_adapter(target, name, timeout=timeout, step=f"retire adapter {name}")
            except WeightSyncError as err:
                logger.warning("%s", err)

    def forget(self, name: str) -> None:
        """An unloaded adapter leaves the roster, and its folder the disk."""
        self.retired.discard(name)
        self.unloading.discard(name)
        folder = self.folders.pop(name, None)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)

    def reload(self, target: Target, in_use: list[tuple[str, Path]], *, timeout: float) -> None:
        """A restarted server gets every adapter still in use (`loaded`, taken on the loop), from its folder
        (written in the background after each sync, by this engine or the trainer's sender: waited for up to
        ``timeout``)."""
        for name, folder in in_use:
            if wait_for_folder(folder, timeout) is None:
                raise WeightSyncError(f"restore adapters: the folder of adapter {name} ({folder}) was not "
                                         f"written within {timeout:.0f} s; the log of the process that synced it "
                                         "says why")
            adapters.load_adapter_from_folder(target, name, folder, timeout=timeout, step="restore adapters")
