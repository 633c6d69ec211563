"""An error raised inside a Ray actor reaches the user as the actor's own one line, not Ray's
flattened remote traceback: a checkpoint the trainer's loader refused (exit 2), a run-time failure (exit 1)."""

import test_cli
from ray.exceptions import RayTaskError
from test_cli import assert_user_error, run

from slime_rl.core.run.checkpoint import CheckpointError

custom_config, fake_loop = test_cli.custom_config, test_cli.fake_loop  # test_cli.py's fixtures

REMOTE_TRACE = "Traceback (most recent call last):\n  File \"actors.py\", line 1, in load\n" * 20


def test_a_checkpoint_refused_in_the_trainer_is_one_line(custom_config, fake_loop):
    cause = CheckpointError("/ckpt/step_000002/actor/.metadata", "refused: unpickling it would call posix.system")
    fake_loop.error = RayTaskError("TrainerWorker.load", REMOTE_TRACE, cause).as_instanceof_cause()
    line = assert_user_error(run("train", custom_config, "--resume"), "/ckpt/step_000002/actor/.metadata")
    assert line == "error: /ckpt/step_000002/actor/.metadata: refused: unpickling it would call posix.system"


def test_a_run_time_failure_in_an_actor_ends_with_its_message(custom_config, fake_loop):
    fake_loop.error = RayTaskError("TrainerWorker.train_step", REMOTE_TRACE,
                                   FloatingPointError("optimizer step 2 has a non-finite loss")).as_instanceof_cause()
    result = run("train", custom_config)
    assert result.exit_code == 1
    assert result.stderr.splitlines()[-1] == "error: training failed: FloatingPointError: optimizer step 2 has a" \
                                             " non-finite loss"
