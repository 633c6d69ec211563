"""A run touches only what it made, and trains only on its own data, with real runs (tiny model, Ray, Megatron
on CPU): the built-in example's folder keeps the user's files through runs, re-runs, a resume and a typo; a fresh
run in a used logging.dir never trains on the earlier run's leftover groups, and a resumed run continues its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slime_rl.core.config import load_config
from slime_rl.core.run import checkpoint

UNRELATED = ("notes.txt", "mine/data.jsonl", "checkpoints/README.txt", "rollout_state/keep.txt", "rollouts/keep.txt",
             "tensorboard/keep.txt", "tensorboard/events.out.tfevents.0.users-own")  # the last named as a run's


def put_unrelated_files(folder: Path) -> dict[str, str]:
    for name in UNRELATED:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(f"the user's {name}\n")
    return {name: f"the user's {name}\n" for name in UNRELATED}


def contents(folder: Path, names) -> dict[str, str | None]:
    return {name: (folder / name).read_text() if (folder / name).is_file() else None for name in names}


def metric_steps(log_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def rollout_rows(log_dir: Path, step: int) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_the_example_folder_keeps_unrelated_files_through_runs_a_resume_and_a_typo(tiny_model_dir, tmp_path):
    workdir = tmp_path / "wd"
    workdir.mkdir()
    unrelated = put_unrelated_files(workdir)
    env = {**os.environ, "SLIME_RL_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1"}
    tiny = [f"model.path={tiny_model_dir}", "model.dtype=float32", "data.rollout_batch_size=2",
            "data.n_samples_per_prompt=2", "rollout.max_response_len=2", "eval.max_response_len=2",
            "trainer.megatron.recompute=false", "logging.save_rollouts=true"]

    def slime_cli(*args: str) -> subprocess.CompletedProcess:
        # umask 000: the run's files would be 0666 if it took the process's umask (they hold samples and weights)
        return subprocess.run([sys.executable, "-m", "slime_rl.cli.app", "train", "--workdir", str(workdir), *args],
                              capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path, umask=0)

    def check(result: subprocess.CompletedProcess, code: int = 0) -> None:
        assert result.returncode == code, result.stdout[-3000:] + result.stderr[-3000:]
        assert contents(workdir, unrelated) == unrelated

    first = slime_cli(*tiny, "data.num_rollout=1")
    check(first)
    first_id = json.loads((workdir / "run.json").read_text())["run_id"]
    _, meta = checkpoint.latest(workdir / "checkpoints")
    assert meta["step"] == 1 and meta["run_id"] == first_id
    made_here = {Path(name) for name in UNRELATED} | {Path(name).parent for name in UNRELATED}
    runs_own = [p for p in workdir.rglob("*") if p.relative_to(workdir) not in made_here]
    assert {"metrics.jsonl", "run.json", "meta.json", "owner.json", "buffer.sqlite"} <= {p.name for p in runs_own}
    assert [p for p in runs_own if p.stat().st_mode & 0o077] == []  # folders 0700, files 0600 at most

    again = slime_cli(*tiny, "data.num_rollout=2")  # a plain re-run: afresh, the first run's output gone
    check(again)
    assert "starts afresh" in again.stdout
    second_id = json.loads((workdir / "run.json").read_text())["run_id"]
    assert second_id != first_id and not (workdir / "rollout_state" / first_id).exists()
    assert metric_steps(workdir) == [0, 1, 2] and checkpoint.latest(workdir / "checkpoints")[1]["step"] == 2

    resumed = slime_cli(*tiny, "data.num_rollout=3", "--resume")
    check(resumed)
    assert "starts afresh" not in resumed.stdout
    assert json.loads((workdir / "run.json").read_text())["run_id"] == second_id
    assert metric_steps(workdir) == [0, 1, 2, 3]  # step 2 (the resume's eval) once
    assert checkpoint.latest(workdir / "checkpoints")[1]["step"] == 3
    assert sorted(p.name for p in (workdir / "rollouts").glob("step_*")) == [f"step_00000{k}.jsonl" for k in (1, 2, 3)]

    typo = slime_cli(*tiny, "rollout.temprature=0.5")  # fails on the config: the run's output stays too
    check(typo, 2)
    assert typo.stderr.startswith("error: rollout.temprature: ") and len(typo.stderr.splitlines()) == 1
    assert checkpoint.latest(workdir / "checkpoints")[1]["step"] == 3 and metric_steps(workdir) == [0, 1, 2, 3]


def write_prompts(path: Path, letter: str) -> Path:
    path.write_text("".join(json.dumps({"input": f"{letter}{i} = ", "label": letter}) + "\n" for i in range(30)))
    return path


@pytest.mark.slow
def test_a_fresh_run_in_a_used_logging_dir_trains_only_on_its_own_prompts_and_a_resumed_one_on_its_own_buffer(
        tiny_model_dir, tmp_path, monkeypatch):
    from slime_rl.core.run.loop import train

    monkeypatch.setenv("TOY_TOKENIZER", str(tiny_model_dir))
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[1] / "support"))  # Ray workers import toy_rewards
    monkeypatch.setenv("SLIME_RL_TORCH_THREADS", "1")
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    unrelated = put_unrelated_files(log_dir)

    def run(letter: str, *extra: str) -> dict:
        # over-sampling: 4 groups generated a step, 2 trained; the others wait in the run's buffer
        return train(load_config(None, [
            f"model.path={tiny_model_dir}", f"data.prompt_data={write_prompts(tmp_path / f'{letter}.jsonl', letter)}",
            "data.rollout_batch_size=2", "rollout.over_sampling_batch_size=4", "data.n_samples_per_prompt=2",
            "rollout.max_response_len=3", "rollout.reward=toy_rewards:digit_token_fraction", "cluster.device=cpu",
            f"logging.dir={log_dir}", "logging.tensorboard=false", "logging.save_rollouts=true",
            f"checkpoint.save_dir={tmp_path / f'ckpt_{letter}'}", *extra]))

    run("a", "data.num_rollout=2")
    run_a = json.loads((log_dir / "run.json").read_text())["run_id"]
    _, meta = checkpoint.latest(tmp_path / "ckpt_a")
    assert meta["run_id"] == run_a
    waiting = meta["rollout_state"]["buffer"]["groups"]  # what run a left in its buffer at its checkpoint
    assert waiting, "over-sampling left no groups in the buffer: the test would prove nothing"

    summary = run("b", "data.num_rollout=2")  # a new run, another prompt file, the same logging.dir
    assert summary["steps"] == 2
    trained_b = [row["prompt"] for step in (1, 2) for row in rollout_rows(log_dir, step)]
    assert len(trained_b) == 8 and all(p.startswith("b") for p in trained_b), trained_b
    assert metric_steps(log_dir) == [1, 2]
    aside = log_dir / "earlier_runs" / run_a  # run a's logs, moved aside, not mixed in or lost
    assert all(row["prompt"].startswith("a") for row in rollout_rows(aside, 1)) and metric_steps(aside) == [1, 2]

    summary = run("a", "data.num_rollout=3", "checkpoint.resume=true")  # run a continues, with its own buffer
    assert summary["start_step"] == 2 and summary["steps"] == 3
    assert json.loads((log_dir / "run.json").read_text())["run_id"] == run_a
    step3 = rollout_rows(log_dir, 3)
    assert all(row["prompt"].startswith("a") for row in step3)
    finished = [g for g in waiting if all(s["status"] in ("completed", "truncated", "failed") for s in g)]
    first_waiting = [s["group_index"] for g in finished[:2] for s in g]  # the buffer hands out oldest first
    assert [row["group_index"] for row in step3][:len(first_waiting)] == first_waiting
    assert metric_steps(log_dir) == [1, 2, 3]  # its own rows back, each step once
    assert all(row["prompt"].startswith("a") for row in rollout_rows(log_dir, 1))
    (run_b,) = [p.name for p in (log_dir / "earlier_runs").iterdir()]  # run b's logs, set aside in their turn
    assert all(row["prompt"].startswith("b") for row in rollout_rows(log_dir / "earlier_runs" / run_b, 1))
    assert contents(log_dir, unrelated) == unrelated

