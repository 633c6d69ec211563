"""What a run owns in its logging.dir: one metrics row per step, even across a resume; an earlier
run's logs set aside (never deleted, never mixed in) and given back when that run resumes."""

import json

import pytest

from slime_rl.core.config import ConfigError
from slime_rl.core.run.metrics import MetricsLogger
from slime_rl.core.run.run_dir import claim_logging_dir, new_run_id, record_logs, rollout_state_dir


def steps(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_a_second_log_of_a_step_merges_into_its_row(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.log(0, {"eval/x": 0.1})
    logger.log(1, {"train/loss": 2.0})
    logger.log(1, {"eval/x": 0.5})  # the eval that closes a run, at its last step
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[1]["train/loss"] == 2.0 and rows[1]["eval/x"] == 0.5


def test_a_resumed_run_supersedes_the_dead_runs_rows_after_its_checkpoint(tmp_path):
    dead = MetricsLogger(tmp_path, tensorboard=False)
    for step in range(0, 6):  # checkpoint at step 3; the run died after writing step 5
        dead.log(step, {"rollout/reward_mean": step / 10})
    dead.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "rollout/rew')  # torn by the kill

    resumed = MetricsLogger(tmp_path, tensorboard=False, resume_step=3)
    assert steps(tmp_path / "metrics.jsonl") == [0, 1, 2, 3]
    resumed.log(3, {"eval/x": 0.7})  # the resumed run's eval at its start step
    for step in range(4, 8):
        resumed.log(step, {"rollout/reward_mean": 1.0})
    resumed.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5, 6, 7]
    assert rows[3]["rollout/reward_mean"] == 0.3 and rows[3]["eval/x"] == 0.7  # step 3's row kept, eval merged
    assert [r["rollout/reward_mean"] for r in rows[4:]] == [1.0] * 4  # the dead run's 4 and 5 superseded


def test_a_fresh_run_sets_an_earlier_runs_logs_aside_and_a_resumed_one_gets_its_own_back(tmp_path):
    log_dir = tmp_path / "logs"
    (log_dir / "rollouts").mkdir(parents=True)
    (log_dir / "notes.txt").write_text("mine")
    (log_dir / "rollouts" / "keep.txt").write_text("mine too")
    first, second = new_run_id(), new_run_id()
    assert first != second and rollout_state_dir(log_dir, first) != rollout_state_dir(log_dir, second)

    assert claim_logging_dir(log_dir, first, resuming=False) == []  # nothing there yet
    (log_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    (log_dir / "rollouts" / "step_000001.jsonl").write_text("first's samples\n")

    notes = claim_logging_dir(log_dir, second, resuming=False)
    assert len(notes) == 1 and "metrics.jsonl, rollouts/ (1 files)" in notes[0] and first in notes[0]
    aside = log_dir / "earlier_runs" / first
    assert (aside / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert (aside / "rollouts" / "step_000001.jsonl").read_text() == "first's samples\n"
    assert not (log_dir / "metrics.jsonl").exists()
    (log_dir / "metrics.jsonl").write_text('{"step": 1, "second": 1}\n')

    notes = claim_logging_dir(log_dir, first, resuming=True)  # the first run resumes here
    assert len(notes) == 2
    assert (log_dir / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert (log_dir / "rollouts" / "step_000001.jsonl").read_text() == "first's samples\n"
    assert (log_dir / "earlier_runs" / second / "metrics.jsonl").read_text() == '{"step": 1, "second": 1}\n'
    assert not aside.exists()
    assert (log_dir / "notes.txt").read_text() == "mine"
    assert (log_dir / "rollouts" / "keep.txt").read_text() == "mine too"
    assert claim_logging_dir(log_dir, first, resuming=True) == []  # its own: nothing moves


def test_logs_from_before_run_ids_are_a_resumed_runs_own_and_refused_to_a_fresh_run(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    assert claim_logging_dir(tmp_path, new_run_id(), resuming=True) == []
    assert (tmp_path / "metrics.jsonl").exists()

    (tmp_path / "run.json").unlink()  # no run proves it now: a fresh run neither moves it nor writes over it
    with pytest.raises(ConfigError, match=r"^logging.dir: .*/metrics.jsonl is not a log that this run or an earlier"
                                          r" one proves it wrote .* move it out of .* or give this run another"):
        claim_logging_dir(tmp_path, new_run_id(), resuming=False)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n' and not (tmp_path / "earlier_runs").exists()


def test_an_unreadable_owner_file_proves_nothing(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "run.json").write_text("{torn")
    with pytest.raises(ConfigError, match="metrics.jsonl is not a log"):
        claim_logging_dir(tmp_path, new_run_id(), resuming=False)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_the_users_own_logs_are_never_moved_and_the_ones_in_the_way_are_refused(tmp_path):
    """The user's own files under a run's log names: with nothing in the way, left where they are (and
    not taken for the run's by the next one); a name the run writes again, refused in one line."""
    users = {"tensorboard/events.out.tfevents.1.users-own": "mine", "rollouts/step_000001.jsonl": "my samples"}
    for name, text in users.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=r"rollouts/step_000001.jsonl is not a log"):
        claim_logging_dir(tmp_path, new_run_id(), resuming=False)
    (tmp_path / "rollouts" / "step_000001.jsonl").rename(tmp_path / "mine.jsonl")

    first = new_run_id()
    assert claim_logging_dir(tmp_path, first, resuming=False) == []
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')  # what the run writes
    (tmp_path / "tensorboard" / "events.out.tfevents.2.run").write_text("run's")
    record_logs(tmp_path)
    (tmp_path / "tensorboard" / "events.out.tfevents.1.users-own").write_text("mine, changed during the run")

    notes = claim_logging_dir(tmp_path, new_run_id(), resuming=False)
    aside = tmp_path / "earlier_runs" / first
    assert len(notes) == 1 and sorted(p.name for p in aside.rglob("*") if p.is_file()) == [
        "events.out.tfevents.2.run", "metrics.jsonl", "run.json"]
    assert (tmp_path / "tensorboard" / "events.out.tfevents.1.users-own").read_text() == "mine, changed during the run"


def test_a_log_the_user_put_in_place_of_the_runs_is_not_the_runs(tmp_path):
    first = new_run_id()
    claim_logging_dir(tmp_path, first, resuming=False)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    record_logs(tmp_path)
    (tmp_path / "metrics.jsonl").unlink()
    (tmp_path / "metrics.jsonl").write_text("the user's own, another file of the same name\n")
    with pytest.raises(ConfigError, match="metrics.jsonl is not a log"):
        claim_logging_dir(tmp_path, new_run_id(), resuming=False)
    assert (tmp_path / "metrics.jsonl").read_text() == "the user's own, another file of the same name\n"


def test_a_log_name_that_is_a_symlink_is_refused_and_not_followed(tmp_path):
    outside = tmp_path / "outside.jsonl"
    outside.write_text("elsewhere\n")
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    (log_dir / "metrics.jsonl").symlink_to(outside)
    (log_dir / "run.json").write_text(json.dumps({"run_id": "20260101-000000-abcdef"}))  # an old run.json
    with pytest.raises(ConfigError, match="metrics.jsonl is not a log"):
        claim_logging_dir(log_dir, new_run_id(), resuming=False)
    assert (log_dir / "metrics.jsonl").is_symlink() and outside.read_text() == "elsewhere\n"
