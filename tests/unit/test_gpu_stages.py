"""Every stage of scripts/gpu/run.sh, checked on the CPU before a device call spends minutes on it: the files it
names exist, its pytest selection (files, -k, -m) imports and selects at least one test, its benchmark's flags
parse with the benchmark's own parser, its shell scripts parse. Nothing GPU runs: run.sh prints each stage's
command (GPU_STAGES_DRY=1), the tests are only collected (tests/support/stage_selection.py) and the benchmarks stop
once their arguments parse (tests/support/benchmark_flags.py)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN_SH = ROOT / "scripts" / "gpu" / "run.sh"
SUPPORT = ROOT / "tests" / "support"
STAGE_LABEL = re.compile(r"^    ([a-z0-9][a-z0-9.|-]*)\) ", re.M)  # the case labels of run.sh's stage switch
REPO_PATH = re.compile(r"\b(?:benchmarks|scripts|tests|packages|examples)/[\w./-]+\.(?:py|sh|yaml)")


def stage_names() -> list[str]:
    return [name for label in STAGE_LABEL.findall(RUN_SH.read_text()) for name in label.split("|")]


@pytest.fixture(scope="module")
def commands(tmp_path_factory) -> dict[str, str]:
    """stage -> its command line as run.sh would run it."""
    out = tmp_path_factory.mktemp("gpu-logs")
    done = subprocess.run(["bash", str(RUN_SH), *stage_names()], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "GPU_STAGES_DRY": "1", "OUT": str(out)}, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = [line.split("\t", 1) for line in done.stdout.splitlines() if "\t" in line]
    return {stage: command.strip() for stage, command in lines}


def argv_of(command: str) -> list[str] | None:
    """The command's words, or None for a `bash -c` script (checked by the paths it names)."""
    words = None if command.startswith("bash -c") else shlex.split(command)
    if words and words[0] == "env":  # env NAME=value ... command
        words = words[1:]
        while words and "=" in words[0]:
            words = words[1:]
    if words and words[0] == "timeout":  # timeout [--signal=...] DURATION command
        words = words[1:]
        while words and words[0].startswith("-"):
            words = words[1:]
        words = words[1:]
    return words


def test_every_stage_prints_its_command(commands):
    assert sorted(commands) == sorted(stage_names())
    assert len(commands) > 40  # the switch was read (a label pattern that matches nothing would pass the rest)


def test_every_file_a_stage_names_exists(commands):
    missing = {stage: path for stage, command in commands.items() for path in REPO_PATH.findall(command)
               if not (ROOT / path.split("::")[0]).exists()}
    assert not missing, missing


def test_every_shell_script_a_stage_runs_parses(commands):
    scripts = {path for command in commands.values() for path in REPO_PATH.findall(command) if path.endswith(".sh")}
    assert scripts
    for script in sorted(scripts):
        done = subprocess.run(["bash", "-n", str(ROOT / script)], capture_output=True, text=True)
        assert done.returncode == 0, f"{script}: {done.stderr}"


def pytest_stages(commands: dict[str, str]) -> dict[str, dict]:
    """stage -> {"targets", "k", "m"} of every stage that runs pytest."""
    specs = {}
    for stage, command in commands.items():
        words = argv_of(command)
        if not words or words[:3] != ["python3", "-m", "pytest"]:
            continue
        args, spec = words[3:], {"targets": [], "k": None, "m": None}
        while args:
            word = args.pop(0)
            if word in ("-k", "-m"):
                spec[word[1]] = args.pop(0)
            elif word == "-p":
                args.pop(0)
            elif not word.startswith("-"):
                spec["targets"].append(word)
        specs[stage] = spec
    return specs


def test_every_pytest_stage_imports_and_selects_tests(commands, tmp_path):
    specs = pytest_stages(commands)
    assert len(specs) > 20
    (tmp_path / "stages.json").write_text(json.dumps(specs))
    files = sorted({t.split("::")[0] for spec in specs.values() for t in spec["targets"]})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")]),
           "STAGE_SELECTIONS_IN": str(tmp_path / "stages.json"), "STAGE_SELECTIONS_OUT": str(tmp_path / "out.json")}
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "stage_selection",
                           "-p", "no:cacheprovider", *files], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]  # a file that does not import fails here
    selected = json.loads((tmp_path / "out.json").read_text())
    empty = {stage: specs[stage] for stage, nodes in selected.items() if not nodes}
    assert not empty, f"stages whose -k/-m select no test: {empty}"


def test_every_benchmark_stage_parses_its_flags(commands, tmp_path):
    calls = []
    for stage, command in commands.items():
        words = argv_of(command)
        if words and words[0] == "python3" and words[1].startswith("benchmarks/"):
            calls.append([stage, str(ROOT / words[1]), words[2:]])
    assert len(calls) > 15
    (tmp_path / "calls.json").write_text(json.dumps(calls))
    done = subprocess.run([sys.executable, str(SUPPORT / "benchmark_flags.py"), str(tmp_path / "calls.json"),
                           str(tmp_path / "results.json")], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    bad = {stage: result for stage, result in results.items() if result != "ok"}
    assert not bad, bad
