"""No source file under packages/*/src is over 600 lines: a module that long holds more than one idea
(split it along a concept, not at the line count)."""

from __future__ import annotations

from pathlib import Path

from source_imports import write_tree

REPO = Path(__file__).resolve().parents[2]
MAX_LINES = 600


def files_over(packages_dir: Path, limit: int = MAX_LINES) -> list[str]:
    """``path: N lines`` for every ``.py`` file under ``packages/*/src`` longer than ``limit``."""
    found = []
    for path in sorted(packages_dir.glob("*/src/**/*.py")):
        if (lines := len(path.read_text().splitlines())) > limit:
            found.append(f"{path.relative_to(packages_dir)}: {lines} lines")
    return found


def test_no_source_file_is_over_600_lines():
    assert files_over(REPO / "packages") == []


def test_a_long_file_is_named(tmp_path):
    packages = write_tree(tmp_path, {
        "core/src/slime_rl/core/long.py": "x = 1\n" * (MAX_LINES + 1),
        "core/src/slime_rl/core/at_limit.py": "x = 1\n" * MAX_LINES,
        "core/tests/test_long.py": "x = 1\n" * (MAX_LINES + 1),  # tests are not source
    })
    assert files_over(packages) == [f"core/src/slime_rl/core/long.py: {MAX_LINES + 1} lines"]
