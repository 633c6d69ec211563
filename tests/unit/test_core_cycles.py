"""No import cycle between core's modules, read from the AST: what a module imports while it is imported
(module level, not under TYPE_CHECKING, not inside a function) must not lead back to it. A lower layer
that needs something of a higher one gets it moved down (CheckpointError sits with the config's errors,
below checkpoint.py and safe_pickle.py) or declares what it needs (weights.sync's TrainerRanks)."""

from __future__ import annotations

from pathlib import Path

from source_imports import imports_of, module_of, source_modules, write_tree

REPO = Path(__file__).resolve().parents[2]
CORE = "slime_rl.core"


def import_time_graph(packages_dir: Path, prefix: str) -> dict[str, set[str]]:
    """Module -> the modules under ``prefix`` it imports while being imported."""
    modules = [m for m in source_modules(packages_dir) if m.name == prefix or m.name.startswith(prefix + ".")]
    names = {m.name for m in modules}
    graph: dict[str, set[str]] = {name: set() for name in names}
    for module in modules:
        for imp in imports_of(module):
            target = module_of(imp.target, names)
            if imp.at_import_time and target is not None and target != module.name:
                graph[module.name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected group of modules (Tarjan's), each as the path ``a -> b -> ... -> a``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while (member := stack.pop()) != node:
                group.add(member)
            if group:
                found.append(_path_through(graph, node, group | {node}))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _path_through(graph: dict[str, set[str]], start: str, group: set[str]) -> list[str]:
    """A shortest way from ``start`` back to itself inside ``group``."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & group):
                if nxt == start:
                    return paths[node] + [start]
                if nxt not in paths:
                    paths[nxt] = paths[node] + [nxt]
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"{start} is in a strongly connected group without a way back")


def test_core_has_no_import_cycle():
    assert [" -> ".join(cycle) for cycle in cycles(import_time_graph(REPO / "packages", CORE))] == []


def test_a_cycle_is_found_and_deferred_imports_are_not_one(tmp_path):
    packages = write_tree(tmp_path, {
        "core/src/slime_rl/core/__init__.py": "",
        "core/src/slime_rl/core/run/checkpoint.py": "from slime_rl.core.infra.safe_pickle import check\n",
        "core/src/slime_rl/core/infra/safe_pickle.py": "from slime_rl.core.run import checkpoint\n",
        "core/src/slime_rl/core/weights/sync.py": """\
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from slime_rl.core.run.loop import TrainerGroup
            """,
        "core/src/slime_rl/core/run/loop.py": """\
            from slime_rl.core.weights.sync import WeightSync
            def train():
                from slime_rl.core import a
            """,
        "core/src/slime_rl/core/a.py": "import slime_rl.core.b\n",
        "core/src/slime_rl/core/b.py": "from slime_rl.core import c\n",
        "core/src/slime_rl/core/c.py": "from slime_rl.core.run.loop import train\n",
    })
    graph = import_time_graph(packages, CORE)
    assert graph["slime_rl.core.weights.sync"] == set()  # under TYPE_CHECKING
    assert graph["slime_rl.core.run.loop"] == {"slime_rl.core.weights.sync"}  # the one inside train() is not
    assert cycles(graph) == [["slime_rl.core.infra.safe_pickle", "slime_rl.core.run.checkpoint",
                              "slime_rl.core.infra.safe_pickle"]]
    graph["slime_rl.core.run.loop"].add("slime_rl.core.a")  # the import in train() moved to the top
    assert sorted(cycles(graph), key=len) == [
        ["slime_rl.core.infra.safe_pickle", "slime_rl.core.run.checkpoint", "slime_rl.core.infra.safe_pickle"],
        ["slime_rl.core.a", "slime_rl.core.b", "slime_rl.core.c", "slime_rl.core.run.loop", "slime_rl.core.a"],
    ]
