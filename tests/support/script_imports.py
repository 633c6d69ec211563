"""Importing the repository's scripts in tests: benchmarks/ and scripts/gpu/ are folders of modules, not packages
on sys.path."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"


def import_script(folder: Path, name: str) -> ModuleType:
    """Module ``name`` of ``folder``, imported with the folder on sys.path only while it imports (a module it
    imports at its top from the same folder is found; sys.path is as it was after)."""
    sys.path.insert(0, str(folder))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(folder))


def benchmark(name: str) -> ModuleType:
    """benchmarks/``name``.py as a module."""
    return import_script(BENCHMARKS, name)
