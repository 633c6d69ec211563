"""A run whose driver is SIGKILLed between checkpoints resumes from the last one, and across
the two runs every prompt is trained on exactly once, in the data source's order."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slime_rl.core.config import load_config
from slime_rl.core.run import checkpoint

TRAIN = "import sys; from slime_rl.core.config import load_config; from slime_rl.core.run.loop import train; " \
        "train(load_config(None, sys.argv[1:]))"


def run_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def kill_then_resume(tiny_model_dir: Path, tmp_path: Path, extra: list[str], rows_before_kill: int) -> tuple[Path, list[str]]:
    """Train 8 steps on 40 toy prompts (a checkpoint every 2), SIGKILL the driver once ``rows_before_kill``
    metric rows exist (past the step-2 checkpoint), check a checkpoint of step 2-7 is there, and resume
    to the end. Returns the run folder and the overrides both runs used."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input": f"x{i} = ", "label": str(i)}) + "\n" for i in range(40)))
    run_dir = tmp_path / "run"
    overrides = [
        f"model.path={tiny_model_dir}", f"data.prompt_data={prompts}", "data.rollout_batch_size=2",
        "data.n_samples_per_prompt=4", "data.num_rollout=8", "rollout.max_response_len=4",
        "rollout.reward=toy_rewards:digit_token_fraction", *extra,
        "cluster.device=cpu", f"logging.dir={run_dir}", "logging.tensorboard=false", "logging.save_rollouts=true",
        "checkpoint.save_interval=2",
    ]
    env = {**os.environ, "TOY_TOKENIZER": str(tiny_model_dir), "PYTHONPATH": str(Path(__file__).parents[1] / "support"),
           "SLIME_RL_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen([sys.executable, "-c", TRAIN, *overrides], env=env, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while len(run_rows(run_dir / "metrics.jsonl")) < rows_before_kill:
            assert first.poll() is None, "the first run ended before it could be killed"
            assert time.time() < deadline, "the first run made no progress"
            time.sleep(0.05)
        os.kill(first.pid, signal.SIGKILL)  # the driver only, mid-run; steps are fast, so where
        first.wait()  # exactly it stops varies: the resume must hold from whichever checkpoint
        _, meta = checkpoint.latest(run_dir / "checkpoints")
        assert 2 <= meta["step"] < 8

        second = subprocess.run([sys.executable, "-c", TRAIN, *overrides, "checkpoint.resume=true"], env=env,
                                capture_output=True, text=True, timeout=600)
        assert second.returncode == 0, second.stderr[-3000:]
        (tmp_path / "resumed_output.txt").write_text(second.stdout + second.stderr)
    finally:
        with_suppressed_kill(first.pid)  # Ray's processes orphaned by the kill
    return run_dir, overrides


SECRETS = ("sk-resume-inline-5b3e8a", "pw-resume-url-2f7c4d", "tok-resume-url-8a1e6b")


@pytest.mark.slow
def test_driver_sigkill_then_resume_skips_and_repeats_no_prompt(tiny_model_dir, tmp_path):
    """With keys in the config (issue 34, secrets): none is in any file of the run (checkpoints' meta.json
    with its saved config, rollouts, logs) or in the resumed run's output."""
    keys = [f"rollout.reward_api_key={SECRETS[0]}",
            f"rollout.reward_url=http://judge:{SECRETS[1]}@127.0.0.1:9/score?token={SECRETS[2]}"]
    run_dir, overrides = kill_then_resume(tiny_model_dir, tmp_path, keys, rows_before_kill=3)
    files = [p for p in tmp_path.rglob("*") if p.is_file() and p.name != "prompts.jsonl"]
    assert [(str(p), s) for p in files for s in SECRETS if s.encode() in p.read_bytes()] == []
    assert checkpoint.latest(run_dir / "checkpoints")[1]["config"]["rollout"]["reward_api_key"] == "<redacted>"

    steps = [json.loads(line)["group_index"] for k in range(1, 9)
             for line in (run_dir / "rollouts" / f"step_{k:06d}.jsonl").read_text().splitlines()]
    # every prompt group once (n_samples_per_prompt samples each), in order, none skipped
    assert steps == [g for g in range(16) for _ in range(4)]
    # and they are the data source's first 16 prompts, in its (shuffled) order
    cfg = load_config(None, overrides)
    from slime_rl.buffer.data_source import PromptDataSource

    expected = [g[0].prompt for g in PromptDataSource.from_config(cfg).get_groups(16)]
    trained = [json.loads((run_dir / "rollouts" / f"step_{k:06d}.jsonl").read_text().splitlines()[i])["prompt"]
               for k in range(1, 9) for i in (0, 4)]
    assert trained == expected
    resumed_rows = run_rows(run_dir / "metrics.jsonl")
    # each step once: the killed run's rows after its checkpoint are superseded by the resumed run's
    assert [row["step"] for row in resumed_rows] == list(range(1, 9))
    assert checkpoint.latest(run_dir / "checkpoints")[1]["step"] == 8


def with_suppressed_kill(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.mark.slow
def test_fully_async_sigkill_then_resume_trains_every_prompt_once_or_records_it(tiny_model_dir, tmp_path):
    """cluster.async_mode=fully: the checkpoint holds the groups in flight and ready (JSON); across the
    killed run and its resume no group is trained twice, and every group the data source handed out is
    trained, still held (ready or in flight), or recorded as filtered, failed or dropped as stale."""
    run_dir, _ = kill_then_resume(tiny_model_dir, tmp_path, ["cluster.async_mode=fully", "rollout.max_staleness=1"],
                                  rows_before_kill=4)

    trained = [json.loads(lines[i])["group_index"] for k in range(1, 9)
               for lines in [(run_dir / "rollouts" / f"step_{k:06d}.jsonl").read_text().splitlines()]
               for i in range(0, len(lines), 4)]
    assert len(trained) == len(set(trained)) == 16  # none twice
    state = checkpoint.latest(run_dir / "checkpoints")[1]["rollout_state"]
    fully = json.loads(json.dumps(state["fully_async"]))  # held as JSON in meta.json
    ledger = fully["ledger"]
    assert ledger["trained"] == trained
    held = [g[0]["group_index"] for g in fully["ready"] + fully["in_flight"]]
    accounted = trained + held + ledger["filtered"] + ledger["failed"] + ledger["dropped_stale"]
    assert len(accounted) == len(set(accounted))
    assert sorted(accounted) == list(range(len(accounted)))  # every group handed out so far, none lost
