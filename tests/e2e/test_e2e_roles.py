"""Served roles through `slime-cli train` on the CPU with the hf engine (issue 39): a scalar reward model and
generative judges, one of which times out (its samples fail as reward failures, the run goes on); and a teacher
whose tokenizer differs is refused with the reason before any rollout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slime_rl.core.testing import tiny_model_folder
from slime_rl.core.testing.roles import tiny_reward_model_folder

SUPPORT = Path(__file__).parents[1] / "support"


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slime_rl.cli.app", "train", *args], env=env, capture_output=True,
                          text=True, timeout=900)


@pytest.fixture
def run_env(tiny_model_dir, monkeypatch) -> dict[str, str]:
    return {**os.environ, "TOY_TOKENIZER": str(tiny_model_dir), "PYTHONPATH": str(SUPPORT),
            "SLIME_RL_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1"}


def base_args(model: Path, tmp_path: Path, steps: int = 3) -> list[str]:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input": p, "label": ""}) + "\n" for p in ["def f(", "x = [", "print("] * 8))
    config = tmp_path / "config.yaml"  # a config file first: overrides alone would run the built-in example
    config.write_text(f"model: {{path: {model}}}\nlogging: {{dir: {tmp_path / 'run'}}}\n")
    return [str(config), f"model.path={model}", "model.dtype=float32", f"data.prompt_data={prompts}", "data.rollout_batch_size=2",
            "data.n_samples_per_prompt=4", f"data.num_rollout={steps}", "rollout.max_response_len=6",
            "trainer.lr=0.01", "cluster.device=cpu", f"logging.dir={tmp_path / 'run'}", "logging.tensorboard=false",
            "logging.progress_bar=false"]


def metrics_of(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def test_a_reward_model_role_scores_every_sample(tiny_model_dir, tmp_path, run_env):
    rm = tiny_reward_model_folder(tmp_path / "rm", tiny_model_dir)
    done = cli(*base_args(tiny_model_dir, tmp_path), "rollout.reward=reward_model",
               f"roles={{rm: {{kind: reward_model, path: {rm}, batch_size: 8}}}}", env=run_env)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [r for r in metrics_of(tmp_path) if "rollout/reward_mean" in r]
    assert len(steps) == 3 and all(r["rollout/samples_failed"] == 0 for r in steps)
    # a random scalar head scores real numbers, not the 0/1 of a rule (and not all alike)
    assert all(r["rollout/reward_std"] > 0 for r in steps)


def test_judges_answer_a_users_reward_and_a_slow_one_fails_only_its_samples(tiny_model_dir, tmp_path, run_env):
    key = "sk-judge-key-never-printed-0123456789"
    done = cli(*base_args(tiny_model_dir, tmp_path), "rollout.reward=judge_rewards:judged",
               f"roles={{judge: {{kind: judge, path: {tiny_model_dir}, api_key: {key}}},"
               f" slow_judge: {{kind: judge, path: {tiny_model_dir}, timeout_s: 0.05, attempts: 2}}}}", env=run_env)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [r for r in metrics_of(tmp_path) if "rollout/reward_mean" in r]
    assert len(steps) == 3
    # samples 0, 4, ... of each step asked the slow judge: a quarter failed, timed out; the rest were judged
    assert all(r["rollout/samples_failed"] == 2 and r["rollout/step_failed"] == 0 for r in steps), steps
    assert key not in done.stdout + done.stderr
    assert key not in (tmp_path / "run" / "metrics.jsonl").read_text()


def test_a_teacher_with_another_tokenizer_is_refused_with_the_reason(tiny_model_dir, tmp_path, run_env):
    from slime_rl.core.testing import train_tokenizer

    other = tiny_model_folder(tmp_path / "other", tokenizer=train_tokenizer(
        ["a different corpus of words"] * 50, vocab_size=300, eos_token="<|endoftext|>",
        pad_token="<|endoftext|>"))
    done = cli(*base_args(tiny_model_dir, tmp_path, steps=1), "algorithm.advantage_estimator=opd",
               f"roles={{teacher: {{kind: teacher, path: {other}}}}}", env=run_env)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "roles.teacher.path: the teacher cannot score the student's tokens: the vocabularies differ" in done.stderr


@pytest.mark.parametrize("mode", ["off", "fully"])
def test_opd_scores_with_the_teacher_in_sync_and_fully_async_runs(tiny_model_dir, tmp_path, run_env, mode):
    """The teacher is the student's own initial weights: at the first step the teacher's prefill log-probs are the
    engine's (the reverse KL ~0); each step's batch is scored by the teacher, generated in place (off) or by the
    engines running on while the trainer trains (fully). A task reward mixed in (opd_reward_coef) moves the
    student; the teacher stays where it was (a role is frozen: no weight sync reaches it), so the KL opens up."""
    async_args = ["cluster.async_mode=fully", "cluster.colocate=false", "rollout.max_staleness=1"] if mode == "fully" \
        else []
    done = cli(*base_args(tiny_model_dir, tmp_path), "algorithm.advantage_estimator=opd",
               f"roles={{teacher: {{kind: teacher, path: {tiny_model_dir}}}}}", "algorithm.opd_reward_coef=1.0",
               "rollout.reward=toy_rewards:digit_token_fraction", *async_args, env=run_env)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [r for r in metrics_of(tmp_path) if "rollout/reward_mean" in r]
    assert len(steps) == 3 and all(r["opd/teacher_tokens"] > 0 and r["time/teacher_prefill"] > 0 for r in steps)
    assert abs(steps[0]["opd/reverse_kl"]) < 1e-4  # same weights, fp32: the teacher agrees with the engine
    assert abs(steps[-1]["opd/reverse_kl"]) > 1e-3, steps  # the student moved; the frozen teacher did not
