"""checkpoint.py: the `latest` pointer and pruning keep what a run just wrote."""

from __future__ import annotations

import pytest

from slime_rl.core.run import checkpoint


def _save(save_dir, step, keep_last=2):
    checkpoint.step_dir(save_dir, step).mkdir(parents=True, exist_ok=True)
    return checkpoint.commit(save_dir, step, {"run": "new"}, keep_last=keep_last)


def test_pruning_keeps_the_last_ones_of_this_run(tmp_path):
    for step in (10, 20, 30):
        _save(tmp_path, step)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000020", "step_000030"]
    folder, meta = checkpoint.latest(tmp_path)
    assert folder.name == "step_000030" and meta["step"] == 30


def test_a_fresh_run_in_an_old_folder_keeps_its_new_checkpoint(tmp_path):
    for step in (10, 20, 30):  # an earlier run
        _save(tmp_path, step)
    folder = _save(tmp_path, 10)  # a new run from step 0 in the same save_dir
    assert folder.is_dir(), "the checkpoint just committed was pruned"
    latest_folder, meta = checkpoint.latest(tmp_path)
    assert latest_folder == folder and meta["step"] == 10
    assert (tmp_path / "step_000030").is_dir()  # later steps of the old run: overwritten when reached, not lost now


def test_a_step_folder_being_rewritten_is_not_a_checkpoint_until_committed(tmp_path):
    for step in (10, 20):  # an earlier run; latest -> step 20
        _save(tmp_path, step)
    folder = checkpoint.prepare(tmp_path, 20)  # a new run starts writing step 20 over it
    with pytest.raises(checkpoint.CheckpointError, match=r"step_000020/meta.json: is missing.*\(step_000010\)"):
        checkpoint.latest(tmp_path)  # a crash now must not resume from half-written files, nor start over
    checkpoint.commit(tmp_path, 20, {"run": "new"}, keep_last=2)
    latest_folder, meta = checkpoint.latest(tmp_path)
    assert latest_folder == folder and (meta["step"], meta["run"]) == (20, "new")


def test_a_fresh_run_refuses_a_save_dir_holding_an_earlier_run(tmp_path):
    from slime_rl.core.config import ConfigError, load_config
    from slime_rl.core.run.loop import train

    _save(tmp_path / "ckpt", 4)
    cfg = load_config(None, [f"checkpoint.save_dir={tmp_path / 'ckpt'}", f"logging.dir={tmp_path / 'run'}"],
                      check=False)
    with pytest.raises(ConfigError, match=r"checkpoint.save_dir: .* step_000004\); continue it with --resume"):
        train(cfg)  # before Ray or any backend starts
    assert checkpoint.latest(tmp_path / "ckpt")[1]["step"] == 4


def _save_as(save_dir, step, run_id, keep_last=None):
    folder = checkpoint.prepare(save_dir, step, run_id)
    (folder / "actor.bin").write_bytes(run_id.encode())
    return checkpoint.commit(save_dir, step, {"run_id": run_id}, keep_last=keep_last)


def test_a_run_writes_into_no_step_folder_another_run_or_no_run_made(tmp_path):
    earlier = _save_as(tmp_path, 10, "run-a")
    (tmp_path / "latest").unlink()  # the pointer removed: the folder is still run a's
    meta_before = (earlier / "meta.json").read_bytes()
    with pytest.raises(checkpoint.CheckpointError, match=r"step_000010: was made by run run-a, not by this run"
                                                         r" \(run-b\); move it out of .* checkpoint.save_dir"):
        checkpoint.prepare(tmp_path, 10, "run-b")
    with pytest.raises(checkpoint.CheckpointError, match=r"was made by run run-a, not by the run committing it"):
        checkpoint.commit(tmp_path, 10, {"run_id": "run-b"})  # nor certifies run a's files as its own
    assert (earlier / "meta.json").read_bytes() == meta_before and (earlier / "actor.bin").read_bytes() == b"run-a"

    users = checkpoint.step_dir(tmp_path, 20)  # a user's own folder that happens to match the name
    users.mkdir()
    (users / "notes.txt").write_text("mine")
    with pytest.raises(checkpoint.CheckpointError, match=r"step_000020: was made by no slime-rl run"):
        checkpoint.prepare(tmp_path, 20, "run-b")
    assert (users / "notes.txt").read_text() == "mine" and not (users / "owner.json").exists()


def test_a_run_writes_again_into_its_own_unfinished_folder(tmp_path):
    folder = checkpoint.prepare(tmp_path, 10, "run-a")  # killed mid-save
    (folder / "actor.bin").write_bytes(b"half")
    assert checkpoint.prepare(tmp_path, 10, "run-a") == folder  # its resume saves step 10 again
    checkpoint.commit(tmp_path, 10, {"run_id": "run-a"})
    assert checkpoint.latest(tmp_path)[1]["run_id"] == "run-a"


def test_pruning_removes_only_the_runs_own_older_checkpoints(tmp_path):
    for step in (10, 20):
        _save_as(tmp_path, step, "run-a")
    (tmp_path / "latest").unlink()
    for step in (30, 40, 50):
        _save_as(tmp_path, step, "run-b", keep_last=1)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000010", "step_000020", "step_000050"]


def test_a_fresh_run_refuses_a_save_dir_whose_latest_was_removed(tmp_path):
    from slime_rl.core.config import ConfigError, load_config
    from slime_rl.core.run.loop import train

    _save_as(tmp_path / "ckpt", 4, "run-a")
    (tmp_path / "ckpt" / "latest").unlink()
    cfg = load_config(None, [f"checkpoint.save_dir={tmp_path / 'ckpt'}", f"logging.dir={tmp_path / 'run'}"],
                      check=False)
    with pytest.raises(ConfigError, match=r"checkpoint.save_dir: .* earlier run \(step_000004, without a latest\)"):
        train(cfg)  # before Ray or any backend starts


def test_a_resume_refuses_a_later_step_folder_it_did_not_make_before_it_starts(tmp_path):
    from slime_rl.core.config import ConfigError, load_config
    from slime_rl.core.run.loop import train

    _save_as(tmp_path / "ckpt", 4, "run-a")
    _save_as(tmp_path / "ckpt", 8, "run-b")  # another run's, beside it
    (tmp_path / "ckpt" / "latest").write_text("step_000004")
    cfg = load_config(None, [f"checkpoint.save_dir={tmp_path / 'ckpt'}", f"logging.dir={tmp_path / 'run'}",
                             "checkpoint.resume=true"], check=False)
    with pytest.raises(ConfigError, match=r"step_000008: was made by run run-b, not by the run resumed \(run-a\)"):
        train(cfg)  # at once, not at step 8's save
    checkpoint.check_steps_ahead(tmp_path / "ckpt", 8, "run-a")  # nothing of another's ahead of step 8
