"""A run cut at its time limit still shows what it printed (tests/support/cut_runs.py): a GPU stage's whole run
that outlasts its call would otherwise return nothing of the steps it finished."""

from __future__ import annotations

import subprocess
import sys

import pytest
from cut_runs import run_printing


def test_a_run_past_its_limit_prints_its_output_then_fails(capsys):
    with pytest.raises(subprocess.TimeoutExpired):
        run_printing([sys.executable, "-u", "-c", "import sys, time; print('step 1 done'); "
                      "print('warned', file=sys.stderr); time.sleep(60)"], timeout=3)
    out = capsys.readouterr().out
    assert "step 1 done" in out and "warned" in out


def test_a_run_within_its_limit_returns_as_subprocess_run_does():
    done = run_printing([sys.executable, "-c", "print('ok')"], timeout=60)
    assert done.returncode == 0 and done.stdout == "ok\n"
