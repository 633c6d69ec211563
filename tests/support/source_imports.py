"""What every module under ``packages/*/src`` imports, read from its AST without importing anything.

The structure tests (tests/unit/test_import_rules.py, test_core_cycles.py) read the tree through this
one reader, so "an import" means the same in both: ``import x``, ``from x import y`` (relative ones
resolved) and ``importlib.import_module``/``__import__`` of a literal string, wherever they stand,
each marked with whether it runs when its module is imported (at module level, not under
``if TYPE_CHECKING:`` and not inside a function).
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SourceModule:
    """One ``.py`` file under a package's ``src`` folder and its dotted module name."""

    name: str  # slime_rl.core.run.loop; a package's __init__.py is the package's own name
    path: Path
    is_package: bool  # an __init__.py: relative imports resolve against the module itself


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # absolute; `from p import n` gives "p.n", a module or a name in p (`module_of` says which)
    line: int
    at_import_time: bool  # runs when the importing module is imported
    path: Path

    def where(self, root: Path) -> str:
        return f"{self.path.relative_to(root)}:{self.line}"


def source_modules(packages_dir: Path) -> list[SourceModule]:
    """Every module of every package: ``packages/<dist>/src/**/*.py``."""
    return [module for src in sorted(packages_dir.glob("*/src")) for module in modules_under(src)]


def modules_under(src: Path) -> list[SourceModule]:
    """The modules of one package's ``src`` folder."""
    modules = []
    for path in sorted(src.rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        modules.append(SourceModule(".".join(parts), path, is_package))
    return modules


def module_of(target: str, names: set[str]) -> str | None:
    """The module of ``names`` an import's target names: itself, or the longest that holds it."""
    parts = target.split(".")
    for end in range(len(parts), 0, -1):
        if (name := ".".join(parts[:end])) in names:
            return name
    return None


def imports_of(module: SourceModule) -> list[Import]:
    tree = ast.parse(module.path.read_text(), filename=str(module.path))
    return list(_Reader(module).read(tree))


class _Reader:
    def __init__(self, module: SourceModule):
        self.module = module

    def read(self, tree: ast.Module) -> Iterator[Import]:
        yield from self._body(tree.body, at_import_time=True)

    def _body(self, nodes: list[ast.stmt], *, at_import_time: bool) -> Iterator[Import]:
        for node in nodes:
            yield from self._node(node, at_import_time=at_import_time)

    def _node(self, node: ast.AST, *, at_import_time: bool) -> Iterator[Import]:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            at_import_time = False  # the body runs when called
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from self._body(node.body, at_import_time=False)
            yield from self._body(node.orelse, at_import_time=at_import_time)
            return
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield self._import(alias.name, node, at_import_time)
        elif isinstance(node, ast.ImportFrom):
            base = self._absolute(node.module, node.level)
            for alias in node.names:
                yield self._import(base if alias.name == "*" else f"{base}.{alias.name}", node, at_import_time)
        elif isinstance(node, ast.Call) and (name := _literal_import(node)):
            yield self._import(name, node, at_import_time)
        for child in ast.iter_child_nodes(node):
            yield from self._node(child, at_import_time=at_import_time)

    def _import(self, target: str, node: ast.AST, at_import_time: bool) -> Import:
        return Import(self.module.name, target, node.lineno, at_import_time, self.module.path)

    def _absolute(self, name: str | None, level: int) -> str:
        if level == 0:
            return name or ""
        package = self.module.name.split(".")
        package = package if self.module.is_package else package[:-1]
        base = package[: len(package) - (level - 1)]
        return ".".join(base + ([name] if name else []))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _literal_import(call: ast.Call) -> str | None:
    """``importlib.import_module("x")``, ``import_module("x")`` or ``__import__("x")``: "x"."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name not in ("import_module", "__import__") or not call.args:
        return None
    first = call.args[0]
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None


def write_tree(root: Path, files: dict[str, str]) -> Path:
    """A source tree for testing a checker: ``{relative path: text}`` (dedented) under ``root``."""
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root
