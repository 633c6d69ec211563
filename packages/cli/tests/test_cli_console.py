"""slime-cli through the installed console script, in a subprocess, as a user runs it."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

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
    info = tmp_path / "slime_rl_extra-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: slime-rl-extra\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(textwrap.dedent("""
        [slime_rl.rollout_engines]
        good-one = good_engine:Engine
        broken-one = missing_engine_module:Engine
    """))
    return tmp_path


def test_doctor_flags_a_broken_backend(plugin_dir):
    env = {"PYTHONPATH": os.pathsep.join([str(plugin_dir), os.environ.get("PYTHONPATH", "")])}
    result = slime_cli("doctor", env=env)
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    good = next(line for line in lines if line.strip().startswith("good-one"))
    broken = next(line for line in lines if line.strip().startswith("broken-one"))
    assert good.strip().endswith("good_engine:Engine, loads")
    assert "does not load: No module named 'missing_engine_module'" in broken
    assert "slime_rl.rollout_engines:broken-one" in lines[-1] and lines[-1].startswith("problems:")
    assert "Traceback" not in result.stdout + result.stderr
