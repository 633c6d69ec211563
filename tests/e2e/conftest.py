"""Every test in tests/e2e is a whole run (Ray, `slime-cli`, a fresh venv, a learning curve): the slow tier,
`make test-slow`. A test that needs no whole run belongs in tests/unit or its package's tests/ (tests/README.md)."""

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(item.fspath).resolve().parents:
            item.add_marker(pytest.mark.slow)
