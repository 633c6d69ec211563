"""Every test module's file name is unique across the repository: pytest imports test files by their base
name (no packages under tests/), so two ``test_x.py`` in different folders stop collection of the whole run."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def clashing_test_names(root: Path) -> dict[str, list[str]]:
    by_name: dict[str, list[str]] = defaultdict(list)
    for folder in [root / "tests", *sorted((root / "packages").glob("*/tests"))]:
        for path in folder.rglob("test_*.py"):
            by_name[path.name].append(str(path.relative_to(root)))
    return {name: sorted(paths) for name, paths in by_name.items() if len(paths) > 1}


def test_test_module_names_are_unique():
    assert clashing_test_names(REPO) == {}


def test_a_clash_is_named(tmp_path):
    for folder in ("tests/unit", "tests/e2e", "packages/core/tests"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "tests/unit/test_a.py").write_text("")
    (tmp_path / "tests/e2e/test_a.py").write_text("")
    (tmp_path / "packages/core/tests/test_b.py").write_text("")
    assert clashing_test_names(tmp_path) == {"test_a.py": ["tests/e2e/test_a.py", "tests/unit/test_a.py"]}
