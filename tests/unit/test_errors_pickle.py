"""Every exception class slime-rl defines survives a pickle round trip, as it must to cross Ray:
one that does not reaches the driver as Ray's UnserializableException with a traceback instead of
its one-line message (DataError and ConfigError did, having a two-argument __init__)."""

from __future__ import annotations

import ast
import importlib
import inspect
import pickle
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def defined_exception_classes() -> list[tuple[str, str]]:
    """(module, class name) of every class in packages/*/src whose bases look like exceptions (read from the
    source, so a new one is found without listing it here)."""
    found = []
    for path in sorted(REPO.glob("packages/*/src/slime_rl/**/*.py")):
        module = ".".join(path.relative_to(path.parents[len(path.relative_to(REPO).parts) - 4]).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    ast.unparse(base).split(".")[-1].endswith(("Error", "Exception")) for base in node.bases):
                found.append((module, node.name))
    return found


CLASSES = defined_exception_classes()


def test_the_discovery_finds_the_errors_that_cross_ray():
    names = {name for _, name in CLASSES}
    assert {"DataError", "ConfigError", "PluginError", "StoreError", "RemoteRewardError"} <= names


@pytest.mark.parametrize("module,name", CLASSES, ids=[n for _, n in CLASSES])
def test_pickle_round_trip_keeps_type_message_and_fields(module, name):
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, BaseException)
    params = [p for p in list(inspect.signature(cls.__init__).parameters.values())[1:]
              if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    # an int field (a signal's number, a count) gets a valid int; every other one a string naming it
    args = [2 if p.annotation in (int, "int") else f"{p.name} value" for p in params] or ["what went wrong and the fix"]
    err = cls(*args)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls
    assert str(back) == str(err) and back.args == err.args
    assert vars(back) == vars(err)  # fields such as DataError.where
