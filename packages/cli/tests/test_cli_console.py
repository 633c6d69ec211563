"""slime-cli through the installed console script, in a subprocess, as a user runs it."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cli_output import step_lines, table_rows

from slime_rl.core.testing.distributions import write_distribution

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "grpo_math.yaml"
SCRIPT = Path(sys.executable).parent / "slime-cli"


def slime_cli(*args, env=None, cwd=None):
    return subprocess.run([str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, cwd=cwd)


def test_console_script_is_installed():
    assert SCRIPT.is_file() and os.access(SCRIPT, os.X_OK)
    result = slime_cli("--version")
    assert result.returncode == 0 and result.stdout.startswith("slime-cli ")


def test_plan_the_example(tmp_path):
    result = slime_cli("plan", EXAMPLE, cwd=tmp_path)  # from elsewhere: the prompt file is found next to the config
    assert result.returncode == 0, result.stderr
    assert "placement on cuda: 4 GPUs on 1 node(s), colocated" in result.stdout
    assert "trainer: 4 ranks, TP=1 PP=1 DP=4" in result.stdout


def test_a_mistake_is_one_line_and_exit_2():
    result = slime_cli("plan", EXAMPLE, "rollout.temprature=0.5")
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == "error: rollout.temprature: unknown key; did you mean `rollout.temperature`?\n"


@pytest.fixture
def plugin_dir(tmp_path):
    """A distribution with one good and one broken rollout engine, found through PYTHONPATH."""
    (tmp_path / "good_engine.py").write_text("class Engine:\n    pass\n")
    write_distribution(tmp_path, "slime-rl-extra", "0.1.0", {"slime_rl.rollout_engines": {
        "good-one": "good_engine:Engine", "broken-one": "missing_engine_module:Engine"}})
    return tmp_path


def test_doctor_flags_a_broken_backend(plugin_dir):
    env = {"PYTHONPATH": os.pathsep.join([str(plugin_dir), os.environ.get("PYTHONPATH", "")])}
    result = slime_cli("doctor", env=env)
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    good = next(line for line in lines if line.strip().startswith("good-one"))
    broken = next(line for line in lines if line.strip().startswith("broken-one"))
    # a loading engine: its entry point, the distribution that registers it, and what it claims
    assert "good_engine:Engine (slime-rl-extra 0.1.0), loads, capabilities: none beyond the core contract" in good
    assert "does not load: No module named 'missing_engine_module'" in broken
    assert "slime_rl.rollout_engines:broken-one" in lines[-1] and lines[-1].startswith("problems:")
    assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.slow
def test_train_the_cpu_default_for_two_steps_ends_with_its_summary(tmp_path):
    """The real demo (SmolLM2-135M, Ray, Megatron on CPU), cut to 2 steps: its log lines, then the table,
    whose figures are the run's own (metrics.jsonl) and whose paths exist."""
    workdir = tmp_path / "wd"
    result = subprocess.run([str(SCRIPT), "train", "data.num_rollout=2", "--workdir", str(workdir)],
                            capture_output=True, text=True, timeout=900, cwd=tmp_path,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout + result.stderr[-5000:]
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["eval/addition/pass@1"] for r in records if "eval/addition/pass@1" in r}
    rewards = {r["step"]: r["rollout/reward_mean"] for r in records if "rollout/reward_mean" in r}
    assert sorted(evals) == [0, 2] and sorted(rewards) == [1, 2]

    lines = step_lines(result.stdout)
    assert len(lines) == 5, result.stdout
    assert lines[0].startswith("started in ") and lines[0].endswith(" s: 2 steps")
    assert lines[1].startswith(f"eval @ step 0: addition/pass@1 {evals[0]:.3f}  ")
    assert lines[2].startswith(f"step 1/2  reward {rewards[1]:.3f} (avg10 {rewards[1]:.3f})  addition/pass@1 ")
    assert lines[3].startswith(f"step 2/2  reward {rewards[2]:.3f} (avg10 {(rewards[1] + rewards[2]) / 2:.3f})")
    assert lines[4].startswith(f"eval @ step 2: addition/pass@1 {evals[2]:.3f}  ")

    rows = table_rows(result.stdout)
    assert rows["addition/pass@1 (greedy accuracy)"] == f"{evals[0]:.3f} -> {evals[2]:.3f}  (step 0 -> 2)"
    assert rows["steps"] == "2 run (now at step 2)"
    assert rows["metrics (JSONL)"] == str(workdir / "metrics.jsonl")
    assert rows["TensorBoard"] == f"tensorboard --logdir {workdir / 'tensorboard'}"
    assert any((workdir / "tensorboard").glob("events.out.tfevents.*"))
    assert rows["checkpoint"] == f"{workdir / 'checkpoints' / 'step_000002'} (step 2; --resume continues from it)"
    assert (workdir / "checkpoints" / "step_000002" / "meta.json").is_file()
    wall = re.fullmatch(r"(\S+) s total: startup (\S+) s, training (\S+) s, median (\S+) s/step", rows["wall time"])
    assert wall, rows["wall time"]
    total, startup, training, per_step = map(float, wall.groups())
    assert 0 < startup and 0 < per_step < training <= total
