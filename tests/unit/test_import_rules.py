"""The package rules of ../shared/DESIGN.md, read from the source's AST (no import, well under a second):
core imports no backend; a backend (buffer, trainer_megatron, rollout_sglang, rollout_hf) imports only core
and itself; the CLI imports only core, wiring backends by entry-point name. Every import counts: inside
functions, under TYPE_CHECKING, and ``importlib.import_module`` of a literal string. The entry points each
pyproject.toml registers name a module of its own package and an attribute that module defines."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

from source_imports import imports_of, modules_under, source_modules, write_tree

REPO = Path(__file__).resolve().parents[2]
CORE = "core"
WHY = {
    CORE: "core imports no backend",
    "cli": "the CLI imports only core: it wires backends by entry-point name",
}


def package_of(module: str) -> str | None:
    """``slime_rl.rollout_hf.engine`` -> ``rollout_hf``; None outside the slime_rl namespace."""
    parts = module.split(".")
    return parts[1] if parts[0] == "slime_rl" and len(parts) > 1 else None


def wrong_way_imports(packages_dir: Path) -> list[str]:
    """``path:line: what imports what (the rule)`` for every import of another slime_rl package than core."""
    found = []
    for module in source_modules(packages_dir):
        own = package_of(module.name)
        for imp in imports_of(module):
            target = package_of(imp.target)
            if target is not None and target not in (CORE, own):
                rule = WHY.get(own or "", "a backend imports only core and itself")
                found.append(f"{imp.where(packages_dir)}: {module.name} imports {imp.target} ({rule})")
    return found


def defined_names(path: Path) -> set[str]:
    """The names a module binds at its top level: what ``module:attr`` can name."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return names


def stray_entry_points(packages_dir: Path) -> list[str]:
    """``pyproject: group: name = value (why)`` for every entry point or script that points outside its own
    package, at a module it does not have or at a name that module does not define."""
    found = []
    for pyproject in sorted(packages_dir.glob("*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text()).get("project", {})
        modules = {module.name: module.path for module in modules_under(pyproject.parent / "src")}
        own = {package_of(name) for name in modules} - {None}
        groups = {"scripts": project.get("scripts", {}), "gui-scripts": project.get("gui-scripts", {}),
                  **project.get("entry-points", {})}
        for group, entries in groups.items():
            for name, value in entries.items():
                module, _, attr = value.partition("[")[0].strip().partition(":")
                where = f"{pyproject.relative_to(packages_dir)}: {group}: {name} = {value!r}"
                if package_of(module) not in own:
                    found.append(f"{where} (not in this package's slime_rl.{'/'.join(sorted(own))})")
                elif module not in modules:
                    found.append(f"{where} (no module {module} under src/)")
                elif attr.split(".")[0] not in defined_names(modules[module]):
                    found.append(f"{where} ({module} defines no {attr.split('.')[0]})")
    return found


def test_every_package_keeps_the_import_rules():
    assert wrong_way_imports(REPO / "packages") == []


def test_every_entry_point_points_into_its_own_package():
    assert stray_entry_points(REPO / "packages") == []


def test_a_wrong_way_import_fails_wherever_it_stands(tmp_path):
    packages = write_tree(tmp_path, {
        "core/src/slime_rl/core/__init__.py": "",
        "core/src/slime_rl/core/fine.py": "from slime_rl.core import sample\nimport os\n",
        "core/src/slime_rl/core/lazy.py": """\
            def engine():
                from slime_rl.rollout_sglang import engine
                return engine
            """,
        "rollout-hf/src/slime_rl/rollout_hf/engine.py": """\
            import importlib
            from slime_rl.core.contracts import RolloutEngine
            from slime_rl.rollout_hf import lora
            from ..trainer_megatron import model
            importlib.import_module("slime_rl.buffer.buffer")
            """,
        "cli/src/slime_rl/cli/doctor.py": """\
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                import slime_rl.trainer_megatron.moe
            """,
    })
    assert wrong_way_imports(packages) == [
        "cli/src/slime_rl/cli/doctor.py:3: slime_rl.cli.doctor imports slime_rl.trainer_megatron.moe (the CLI"
        " imports only core: it wires backends by entry-point name)",
        "core/src/slime_rl/core/lazy.py:2: slime_rl.core.lazy imports slime_rl.rollout_sglang.engine (core"
        " imports no backend)",
        "rollout-hf/src/slime_rl/rollout_hf/engine.py:4: slime_rl.rollout_hf.engine imports"
        " slime_rl.trainer_megatron.model (a backend imports only core and itself)",
        "rollout-hf/src/slime_rl/rollout_hf/engine.py:5: slime_rl.rollout_hf.engine imports slime_rl.buffer.buffer"
        " (a backend imports only core and itself)",
    ]


def test_an_entry_point_outside_its_package_or_to_nothing_fails(tmp_path):
    packages = write_tree(tmp_path, {
        "rollout-hf/src/slime_rl/rollout_hf/engine.py": "class HFEngine:\n    pass\n",
        "rollout-hf/pyproject.toml": """\
            [project.entry-points."slime_rl.rollout_engines"]
            hf = "slime_rl.rollout_hf.engine:HFEngine"
            sglang = "slime_rl.rollout_sglang.engine:SGLangEngine"
            gone = "slime_rl.rollout_hf.old_engine:HFEngine"
            renamed = "slime_rl.rollout_hf.engine:HfEngine"
            [project.scripts]
            hf-cli = "slime_rl.cli.app:main"
            """,
    })
    where = "rollout-hf/pyproject.toml: "
    assert stray_entry_points(packages) == [
        where + "scripts: hf-cli = 'slime_rl.cli.app:main' (not in this package's slime_rl.rollout_hf)",
        where + "slime_rl.rollout_engines: sglang = 'slime_rl.rollout_sglang.engine:SGLangEngine' (not in this"
        " package's slime_rl.rollout_hf)",
        where + "slime_rl.rollout_engines: gone = 'slime_rl.rollout_hf.old_engine:HFEngine' (no module"
        " slime_rl.rollout_hf.old_engine under src/)",
        where + "slime_rl.rollout_engines: renamed = 'slime_rl.rollout_hf.engine:HfEngine'"
        " (slime_rl.rollout_hf.engine defines no HfEngine)",
    ]
