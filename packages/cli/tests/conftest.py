"""Fixtures shared by the cli tests (fixtures only: a helper that tests import goes in a plain module such as
cli_output.py, since 'conftest' resolves to another package's in a whole-repo run)."""

from __future__ import annotations

import sys
import types

import pytest


@pytest.fixture
def loop_never_entered(monkeypatch):
    """Stands in for slime_rl.core.run.loop, which starts Ray: a refused config never gets there."""
    module = types.ModuleType("slime_rl.core.run.loop")
    module.calls = []
    module.train = lambda cfg, callback=None: module.calls.append(cfg)
    monkeypatch.setitem(sys.modules, "slime_rl.core.run.loop", module)
    return module


@pytest.fixture(autouse=True)
def output_to_a_pipe(monkeypatch):
    """slime-cli's output as a pipe gets it: no terminal width inherited from what runs pytest (pytest-xdist's
    workers have COLUMNS=80), so its tables keep a logged path on one line; a test wanting a width sets one."""
    monkeypatch.delenv("COLUMNS", raising=False)
