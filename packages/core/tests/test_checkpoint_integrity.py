"""What a resume relies on: it continues from the newest checkpoint only when that checkpoint is
there and intact, and otherwise stops with one line naming what it found and the way on."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from slime_rl.core.run import checkpoint
from slime_rl.core.run.checkpoint import CheckpointError


def _save(save_dir: Path, step: int) -> Path:
    """A committed checkpoint with files like a trainer's: a torch distributed checkpoint (its index and
    a shard), a JSON file, a nested one."""
    folder = _save_dcp(save_dir, step)
    (folder / "actor" / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    (folder / "rollout.json").write_text(json.dumps({"epoch": 0, "position": 8 * step}))
    return checkpoint.commit(save_dir, step, {"rollout_state": {"data_source": {"position": 8 * step}}})


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_an_intact_checkpoint_verifies(tmp_path):
    _save(tmp_path, 2)
    folder, meta = checkpoint.resume_point(tmp_path)
    assert folder.name == "step_000002" and meta["step"] == 2
    assert meta["rollout_state"] == {"data_source": {"position": 16}}
    assert sorted(meta["files"]) == ["actor/.metadata", "actor/__0_0.distcp", "actor/metadata.json", "rollout.json"]


@pytest.mark.parametrize("name", ["actor/__0_0.distcp", "actor/metadata.json", "rollout.json"])
def test_a_flipped_bit_in_any_file_stops_the_resume_naming_it(tmp_path, name):
    folder = _save(tmp_path, 2)
    _flip(folder / name, offset=5)
    with pytest.raises(CheckpointError) as err:
        checkpoint.resume_point(tmp_path)
    assert str(err.value).startswith(f"{folder / name}: is damaged: its CRC-32 differs from the one written at step 2")
    assert "without --resume" in str(err.value) and "\n" not in str(err.value)


def test_a_truncated_missing_or_extra_file_stops_the_resume(tmp_path):
    folder = _save(tmp_path, 2)
    shard = folder / "actor" / "__0_0.distcp"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=rf"__0_0.distcp: is damaged: {size - 10} bytes, {size} when written at step 2"):
        checkpoint.resume_point(tmp_path)
    shard.unlink()
    with pytest.raises(CheckpointError, match=r"__0_0.distcp: is missing from the checkpoint"):
        checkpoint.resume_point(tmp_path)

    folder = _save(tmp_path, 4)
    (folder / "actor" / "common.pt").write_bytes(b"not written by the run")  # a loader would read it
    with pytest.raises(CheckpointError, match=r"actor/common.pt: is not one of the files written with this"):
        checkpoint.resume_point(tmp_path)


def test_damage_to_meta_json_itself_is_found(tmp_path):
    folder = _save(tmp_path, 2)
    _save(tmp_path, 4)
    meta_file = tmp_path / "step_000004" / "meta.json"
    text = meta_file.read_text()
    # still valid JSON: a digit of the data position the resumed run would continue from
    meta_file.write_text(text.replace('"position": 32', '"position": 33'))
    with pytest.raises(CheckpointError) as err:
        checkpoint.resume_point(tmp_path)
    message = str(err.value)
    assert message.startswith(f"{meta_file}: is damaged (its content does not match its checksum)")
    assert f"write its folder name ({folder.name}) into {tmp_path / 'latest'}" in message  # the older one

    meta_file.write_bytes(b"\xff" + text.encode()[1:])
    with pytest.raises(CheckpointError, match=r"meta.json: is damaged \(not JSON"):
        checkpoint.resume_point(tmp_path)
    meta_file.unlink()
    with pytest.raises(CheckpointError, match=r"step_000004/meta.json: is missing: the save of this step did not"):
        checkpoint.resume_point(tmp_path)


def test_latest_naming_a_folder_that_is_gone_stops_the_resume(tmp_path):
    import shutil

    _save(tmp_path, 2)
    shutil.rmtree(_save(tmp_path, 4))
    with pytest.raises(CheckpointError) as err:
        checkpoint.resume_point(tmp_path)
    assert str(err.value).startswith(f"{tmp_path / 'latest'}: names 'step_000004', which is not a checkpoint folder")
    assert "(step_000002)" in str(err.value)
    (tmp_path / "latest").write_bytes(b"\x00\x01")
    with pytest.raises(CheckpointError, match=r"latest: names .*which is not a checkpoint folder"):
        checkpoint.resume_point(tmp_path)


def test_resume_without_any_checkpoint_says_to_start_again_without_it(tmp_path):
    with pytest.raises(CheckpointError) as err:
        checkpoint.resume_point(tmp_path / "never")
    assert str(err.value).startswith(f"checkpoint.resume: {tmp_path / 'never'} holds no checkpoint to resume from"
                                     " (the folder does not exist); start again without --resume")
    _save(tmp_path / "unpointed", 2)
    (tmp_path / "unpointed" / "latest").unlink()
    with pytest.raises(CheckpointError, match=r"unpointed/latest: is missing, though complete checkpoints are here \(step_000002\)"):
        checkpoint.resume_point(tmp_path / "unpointed")
    checkpoint.prepare(tmp_path / "killed", 2)  # killed during its first save
    with pytest.raises(CheckpointError, match=r"\(step_000002 without meta.json: saves that did not finish\);"
                                              r" start again without --resume .*the data from the beginning"):
        checkpoint.resume_point(tmp_path / "killed")


def test_a_resumed_run_fails_before_anything_starts(tmp_path):
    """Through the loop: exit 2's error, before Ray or a backend starts (no model exists here)."""
    from slime_rl.core.config import load_config
    from slime_rl.core.run.loop import train

    _save(tmp_path / "ckpt", 2)
    _flip(tmp_path / "ckpt" / "step_000002" / "rollout.json", offset=3)
    cfg = load_config(None, [f"checkpoint.save_dir={tmp_path / 'ckpt'}", f"logging.dir={tmp_path / 'run'}",
                             "checkpoint.resume=true", "model.path=/nowhere"], check=False)
    with pytest.raises(CheckpointError, match=r"rollout.json: is damaged"):
        train(cfg)
    cfg = load_config(None, [f"checkpoint.save_dir={tmp_path / 'none'}", f"logging.dir={tmp_path / 'run'}",
                             "checkpoint.resume=true", "model.path=/nowhere"], check=False)
    with pytest.raises(CheckpointError, match=r"checkpoint.resume: .* holds no checkpoint"):
        train(cfg)
    import ray

    assert not ray.is_initialized() and not (tmp_path / "run").exists()


def _save_dcp(save_dir: Path, step: int) -> Path:
    """A step folder whose actor/ is a real torch distributed checkpoint (one process: one shard), uncommitted."""
    import torch
    from torch.distributed.checkpoint import FileSystemWriter, save

    folder = checkpoint.prepare(save_dir, step)
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": one process, as meant
        warnings.simplefilter("ignore", UserWarning)
        save({"weight": torch.arange(16.0)}, storage_writer=FileSystemWriter(str(folder / "actor"),
                                                                             single_file_per_rank=True))
    return folder


def test_a_checkpoint_missing_its_index_or_a_shard_is_not_committed(tmp_path):
    """Two runs in one save_dir: one renamed the other's .metadata away, and that one committed without it."""
    _save(tmp_path, 2)
    folder = _save_dcp(tmp_path, 4)
    (folder / "actor" / ".metadata").unlink()
    with pytest.raises(CheckpointError) as err:
        checkpoint.commit(tmp_path, 4, {"rollout_state": {}})
    assert str(err.value).startswith(f"{folder / 'actor' / '.metadata'}: is missing, so step 4 is not committed")
    assert str(err.value).endswith("latest still names step_000002") and "\n" not in str(err.value)
    assert not (folder / "meta.json").exists() and checkpoint.resume_point(tmp_path)[1]["step"] == 2

    folder = _save_dcp(tmp_path, 6)
    (folder / "actor" / "__0_0.distcp").unlink()  # a rank's shard, named in the index
    with pytest.raises(CheckpointError, match=r"step_000006/actor/__0_0.distcp: is missing, so step 6 is not"):
        checkpoint.commit(tmp_path, 6, {"rollout_state": {}})
    checkpoint.prepare(tmp_path, 8)  # the critic's save never happened
    with pytest.raises(CheckpointError, match=r"step_000008/critic: is missing, so step 8 is not committed"):
        checkpoint.commit(tmp_path, 8, {"rollout_state": {}}, needs=("critic",))
    assert checkpoint.latest_name(tmp_path) == "step_000002"

    _save_dcp(tmp_path, 10)
    checkpoint.commit(tmp_path, 10, {"rollout_state": {}}, needs=("actor",))  # complete: committed
    assert checkpoint.resume_point(tmp_path)[1]["step"] == 10


def test_resume_refuses_a_checkpoint_committed_without_its_index(tmp_path):
    """A step-1 checkpoint committed (by e2c9e21) without .metadata: every file meta.json lists passes
    its CRC, so only the load refused it. The resume refuses it before anything loads."""
    folder = _save_dcp(tmp_path, 1)
    checkpoint.commit(tmp_path, 1, {"rollout_state": {}})
    (folder / "actor" / ".metadata").unlink()
    meta = json.loads((folder / "meta.json").read_text())  # meta.json as it was written then: without it
    del meta["files"]["actor/.metadata"]
    meta["checksum"] = checkpoint._content_checksum(meta)
    checkpoint.write_json_atomic(folder / "meta.json", meta)
    with pytest.raises(CheckpointError) as err:
        checkpoint.resume_point(tmp_path)
    assert str(err.value).startswith(f"{folder / 'actor' / '.metadata'}: is missing: the checkpoint was committed"
                                     " incomplete; to start afresh, run without --resume")
