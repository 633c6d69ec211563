"""A full disk during a checkpoint save (issue 34, bad values): one line naming the folder, how much to free
and where else to save, not 85 lines of torch's ``enforce fail``; the partial step folder is removed and the
checkpoint committed before is untouched."""

from __future__ import annotations

import errno
import os
import pickle
import subprocess
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter, save

from slime_rl.core.config import RunFailedError, load_config
from slime_rl.core.run import checkpoint, loop
from slime_rl.core.run.actors import TrainerWorker
from slime_rl.core.testing.full_disk import DiskThatFills

SHARD_BYTES = 64 * 1024 * 4  # the stand-in trainer's one float32 tensor


class _Trainer:
    """A trainer rank whose save is torch's distributed checkpoint writer, as Megatron's is."""

    def save(self, path: str) -> None:
        # no_dist: one process whatever ran before it in this one (a default process group an earlier test left
        # makes torch gather the rank's error through pickling, which drops the OSError from its context; the
        # driver's disk-usage check is what catches a real full disk then: test_a_real_full_disk_during_a_save)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            save({"weight": torch.ones(64 * 1024)}, storage_writer=FileSystemWriter(path, single_file_per_rank=True),
                 no_dist=True)


class _Ranks:
    """TrainerGroup with its one rank in this process: the rank's own TrainerWorker.save, no Ray."""

    def __init__(self):
        self.worker = SimpleNamespace(trainer=_Trainer())

    def save(self, path: str) -> None:
        try:
            TrainerWorker.save(self.worker, path)
        except BaseException as err:  # as Ray hands it to the driver: pickled (which drops __context__), wrapped
            raise _with_cause(pickle.loads(pickle.dumps(err))) from None


def _run(tmp_path: Path) -> SimpleNamespace:
    """What loop._save reads of a Run, the trainer writing for real and the rollout state at hand."""
    cfg = load_config(None, [f"checkpoint.save_dir={tmp_path / 'ckpt'}", f"logging.dir={tmp_path / 'logs'}",
                             "checkpoint.keep_last=2"], check=False)
    return SimpleNamespace(cfg=cfg, actor=_Ranks(), critic=None, run_id="run-1",
                           rollout=SimpleNamespace(state_dict=SimpleNamespace(remote=lambda: "ref")),
                           ask_rollout=lambda call, ref: {"data_source": {"position": 8}})


def test_a_full_disk_during_a_save_is_one_line_and_leaves_no_partial_folder(tmp_path, monkeypatch):
    run = _run(tmp_path)
    save_dir = tmp_path / "ckpt"
    loop._save(run, 1)  # a checkpoint committed before the disk fills
    committed = checkpoint.resume_point(save_dir)[1]
    DiskThatFills(room=SHARD_BYTES // 4).patch(monkeypatch)
    with pytest.raises(RunFailedError) as err:
        loop._save(run, 2)
    message = str(err.value)
    assert message.startswith(f"no space left on device writing {save_dir / 'step_000002'}; free ")
    assert " or point checkpoint.save_dir elsewhere" in message and "\n" not in message, message
    assert "enforce fail" not in message and "Traceback" not in message
    assert not (save_dir / "step_000002").exists()  # the partial folder is gone
    assert sorted(p.name for p in save_dir.iterdir() if p.name.startswith("step_")) == ["step_000001"]
    monkeypatch.undo()
    folder, meta = checkpoint.resume_point(save_dir)  # nothing committed before is lost
    assert folder.name == "step_000001" and meta["files"] == committed["files"]


def test_the_first_save_on_a_full_disk_says_at_least_what_it_wrote(tmp_path, monkeypatch):
    run = _run(tmp_path)
    DiskThatFills(room=1000).patch(monkeypatch)
    with pytest.raises(RunFailedError, match=r"^no space left on device writing .*step_000001; free at least"):
        loop._save(run, 1)
    assert not (tmp_path / "ckpt" / "step_000001").exists()


def test_enospc_is_found_however_torch_and_ray_wrap_it():
    from slime_rl.core.run.disk_full import DiskFullError, no_space_in

    enforce = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    enforce.__context__ = OSError(errno.ENOSPC, "No space left on device")
    wrapped = type("CheckpointException", (BaseException,), {})("ranks: [0]")
    wrapped.failures = {0: (enforce, None)}
    assert no_space_in(wrapped)
    assert no_space_in(_with_cause(DiskFullError("no space left on device writing /x")))
    assert not no_space_in(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"))
    assert not no_space_in(OSError(errno.EACCES, "Permission denied"))


def _with_cause(cause: BaseException) -> Exception:
    """As Ray hands an actor's error to the driver: a wrapper whose ``cause`` is the actor's exception."""
    err = RuntimeError("ray::TrainerWorker.save() failed")
    err.cause = cause
    return err


@pytest.fixture
def small_disk(tmp_path):
    """A real 384 KiB filesystem (tmpfs; needs root): room for one checkpoint of the stand-in trainer, not two."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=384k", "tmpfs", str(disk)],
                                                   capture_output=True).returncode == 0
    if not mounted:
        pytest.skip("mounting a tmpfs needs root (CI runs this as root); the patched-writer tests above cover the rest")
    yield disk
    subprocess.run(["umount", str(disk)], check=True)


def test_a_real_full_disk_during_a_save(tmp_path, small_disk):
    """torch on a filesystem that fills: its error says only 'enforce fail ... unexpected pos', the ENOSPC in
    its __context__ (which Ray's pickling drops)."""
    run = _run(tmp_path)
    run.cfg.checkpoint.save_dir = str(small_disk)
    loop._save(run, 1)
    with pytest.raises(RunFailedError) as err:
        loop._save(run, 2)
    assert str(err.value).startswith(f"no space left on device writing {small_disk / 'step_000002'}; free ")
    assert not (small_disk / "step_000002").exists()
    assert checkpoint.resume_point(small_disk)[0].name == "step_000001"
