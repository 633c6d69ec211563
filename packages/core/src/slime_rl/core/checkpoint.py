"""Checkpoint folders: ``<save_dir>/step_<k>/`` plus a ``latest`` pointer written last.

A checkpoint counts only once its ``meta.json`` exists and ``latest`` names it, so
a run killed mid-save resumes from the previous, complete one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any


def step_dir(save_dir: str | Path, step: int) -> Path:
    return Path(save_dir) / f"step_{step:06d}"


def prepare(save_dir: str | Path, step: int) -> Path:
    """The folder to write step ``step`` into. One left by an earlier run in the same save_dir
    loses its ``meta.json`` first: until this run commits it, it is not a checkpoint."""
    folder = step_dir(save_dir, step)
    (folder / "meta.json").unlink(missing_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def commit(save_dir: str | Path, step: int, meta: dict[str, Any], keep_last: int | None = None) -> Path:
    """Mark ``step_dir(step)`` complete and point ``latest`` at it; prune old ones."""
    folder = step_dir(save_dir, step)
    write_json_atomic(folder / "meta.json", {"step": step, **meta})
    latest = Path(save_dir) / "latest"
    tmp = latest.with_suffix(".tmp")
    tmp.write_text(folder.name)
    os.replace(tmp, latest)
    if keep_last:
        # Only this run's past: a folder may still hold later steps of an earlier run (a fresh
        # start in the same save_dir), and pruning by name would delete what was just written.
        done = sorted(p for p in Path(save_dir).glob("step_*")
                      if (p / "meta.json").exists() and (k := _step_of(p)) is not None and k <= step)
        for old in done[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return folder


def _step_of(folder: Path) -> int | None:
    try:
        return int(folder.name.removeprefix("step_"))
    except ValueError:
        return None


def latest(save_dir: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest complete checkpoint and its meta, or None."""
    pointer = Path(save_dir) / "latest"
    if not pointer.is_file():
        return None
    folder = Path(save_dir) / pointer.read_text().strip()
    meta_file = folder / "meta.json"
    if not meta_file.is_file():
        return None
    return folder, json.loads(meta_file.read_text())
