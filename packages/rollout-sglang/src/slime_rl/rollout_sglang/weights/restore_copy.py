"""The copy of the last synced weights that a restarted SGLang server is restored from, when the
trainer pushed them itself (CUDA IPC, NCCL or CPU tensors straight to the servers).

The engine never sees those tensors, so without this a server that died after the first sync could
only come back with the model's initial weights, and its recovery failed. Trainer rank 0 copies each
bucket to host memory as it pushes it (pinned buffers reused from sync to sync, the device-to-host
copies queued behind the push) and a background thread writes the complete version as an HF folder,
``<weights_dir>/restore/v<version>``, renamed into place only once complete; the version before is
removed then. The engine's recovery waits (up to its sync timeout) for the folder of the version it
needs (`wait_for_version`). Trainer and engines must share the folder (one node, or a shared disk).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from slime_rl.core.contracts import NamedTensors
from slime_rl.rollout_sglang.weights.background_write import BackgroundWrite, wait_for_folder
from slime_rl.rollout_sglang.weights.disk import save_hf_folder


def restore_dir(weights_dir: str | Path) -> Path:
    return Path(weights_dir) / "restore"


def version_folder(weights_dir: str | Path, version: int) -> Path:
    return restore_dir(weights_dir) / f"v{version}"


class RestoreCopy:
    """Host copies of the version being pushed, written out once its last bucket is in (see the module)."""

    def __init__(self, weights_dir: str | Path, model_path: str | Path):
        self.weights_dir, self.model_path = Path(weights_dir), Path(model_path)
        self._held: dict[str, torch.Tensor] = {}
        self._names: list[str] = []  # this version's, in push order
        self.writes = BackgroundWrite(f"the restore copy of the weights under {restore_dir(weights_dir)}",
                                      "a server that dies now cannot be restored until the next copy is written")

    def add(self, bucket: NamedTensors, *, first: bool) -> None:
        """Queue this bucket's copy to host memory (``first``: the first bucket of a version)."""
        if first:
            self.writes.wait()  # the writer still reads the buffers of the version before
            self.writes.report()  # only a restart needs the copy: the run goes on, and says so
            self._names = []
        for name, tensor in bucket:
            held = self._held.get(name)
            if held is None or held.shape != tensor.shape or held.dtype != tensor.dtype:
                held = self._held[name] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
            held.copy_(tensor.detach(), non_blocking=tensor.is_cuda)
            self._names.append(name)

    def finish(self, version: int) -> None:
        """The version's last bucket is in: write the folder in the background."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the queued device-to-host copies
        named = [(name, self._held[name]) for name in self._names]
        self.writes.start(lambda: self._write(version, named), name=f"restore-copy-v{version}")

    def _write(self, version: int, named: NamedTensors) -> None:
        final = version_folder(self.weights_dir, version)
        partial = final.with_name(f"{final.name}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        save_hf_folder(named, partial, self.model_path)
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        for old in restore_dir(self.weights_dir).glob("v*"):
            if old != final:
                shutil.rmtree(old, ignore_errors=True)


def wait_for_version(weights_dir: str | Path, version: int, timeout: float) -> Path | None:
    """The restore folder of ``version`` once it is complete; None if it is not there within ``timeout``."""
    return wait_for_folder(version_folder(weights_dir, version), timeout)
