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
