"""A pytest plugin for tests/unit/test_gpu_stages.py: collects the GPU stages' test files once and writes, for
each stage, the tests its own ``-k`` and ``-m`` select (with pytest's own matchers), so that a stage whose
selection is empty or whose files do not import is found on the CPU, not in a device call.

    STAGE_SELECTIONS_IN=stages.json STAGE_SELECTIONS_OUT=selected.json pytest --collect-only -p stage_selection FILES

stages.json: ``{stage: {"targets": [file or node id, ...], "k": expr or null, "m": expr or null}}``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from _pytest.mark import KeywordMatcher, MarkMatcher
from _pytest.mark.expression import Expression


def _targets(item, targets: list[str], root: Path) -> bool:
    nodeid = item.nodeid
    path = str(Path(item.fspath).resolve().relative_to(root))
    return any(t == path or nodeid == t or nodeid.startswith(t + "[") for t in targets)


def pytest_collection_finish(session) -> None:
    stages = json.loads(Path(os.environ["STAGE_SELECTIONS_IN"]).read_text())
    root = Path(str(session.config.rootpath)).resolve()
    selected = {}
    for stage, spec in stages.items():
        keep = [item for item in session.items if _targets(item, spec["targets"], root)]
        if spec.get("k"):
            expr = Expression.compile(spec["k"])
            keep = [item for item in keep if expr.evaluate(KeywordMatcher.from_item(item))]
        if spec.get("m"):
            expr = Expression.compile(spec["m"])
            keep = [item for item in keep if expr.evaluate(MarkMatcher.from_markers(item.iter_markers()))]
        selected[stage] = [item.nodeid for item in keep]
    Path(os.environ["STAGE_SELECTIONS_OUT"]).write_text(json.dumps(selected))
