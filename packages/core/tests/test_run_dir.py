"""What a run owns in its logging.dir: one metrics row per step, even across a resume; an earlier
run's logs set aside (never deleted, never mixed in) and given back when that run resumes."""

import json

from slime_rl.core.run.metrics import MetricsLogger
from slime_rl.core.run.run_dir import claim_logging_dir, new_run_id, rollout_state_dir


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


def test_logs_from_before_run_ids_are_a_resumed_runs_own_and_an_earlier_run_to_a_fresh_one(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    assert claim_logging_dir(tmp_path, new_run_id(), resuming=True) == []
    assert (tmp_path / "metrics.jsonl").exists()

    (tmp_path / "run.json").unlink()
    notes = claim_logging_dir(tmp_path, new_run_id(), resuming=False)
    assert len(notes) == 1 and not (tmp_path / "metrics.jsonl").exists()
    (aside,) = (tmp_path / "earlier_runs").iterdir()
    assert aside.name.startswith("unknown-") and (aside / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_an_unreadable_owner_file_counts_as_no_owner(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "run.json").write_text("{torn")
    assert len(claim_logging_dir(tmp_path, new_run_id(), resuming=False)) == 1
    assert json.loads((tmp_path / "run.json").read_text())["run_id"]
