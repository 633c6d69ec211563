"""What a run owns in its ``logging.dir``, so that a new run never consumes, mixes with or deletes an earlier one's.

A run gets an id when it starts afresh; every checkpoint's meta records it, so a resumed run is the same run.

- Rollout state (the buffer's SQLite file of scored and partial groups): ``rollout_state/<run id>/``. A fresh
  run starts with an empty buffer and never opens another run's, which stays where it is.
- Logs (``metrics.jsonl``, ``rollouts/step_*.jsonl``, TensorBoard events) belong to the run named in ``run.json``.
  A run that finds another run's logs there moves them to ``earlier_runs/<that run's id>/`` and says so; a resumed
  run whose logs were moved aside that way gets them back. Logs with no owner (from before run ids) are an
  earlier run's to a fresh run, and a resumed run's own.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path

OWNER_FILE = "run.json"
EARLIER_RUNS = "earlier_runs"
# What a run writes into logging.dir, as globs relative to it; nothing else there is touched.
LOG_ARTIFACTS = ("metrics.jsonl", "rollouts/step_*.jsonl", "tensorboard/events.out.tfevents.*")


def new_run_id() -> str:
    """Sortable by start time, unique across runs started in the same second."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def rollout_state_dir(log_dir: str | Path, run_id: str) -> Path:
    return Path(log_dir) / "rollout_state" / run_id


def log_artifacts(log_dir: Path) -> list[Path]:
    return sorted(p for pattern in LOG_ARTIFACTS for p in log_dir.glob(pattern) if p.is_file())


def claim_logging_dir(log_dir: str | Path, run_id: str, *, resuming: bool) -> list[str]:
    """Make ``log_dir``'s logs this run's (see the module docstring); returns what was moved, as messages."""
    log_dir = Path(log_dir)
    owner_file = log_dir / OWNER_FILE
    owner = _owner(owner_file)
    notes: list[str] = []
    if owner != run_id and not (owner is None and resuming):
        found = log_artifacts(log_dir)
        if found:
            folder = _unused(log_dir / EARLIER_RUNS / (owner or "unknown-" + _stamp(found)))
            _move(found, log_dir, folder)
            notes.append(f"logging.dir {log_dir} held the logs of an earlier run ({', '.join(_names(found, log_dir))}); "
                         f"moved them to {folder}")
        mine = log_dir / EARLIER_RUNS / run_id
        if resuming and mine.is_dir():  # a later run had set this run's logs aside
            back = log_artifacts(mine)
            _move(back, mine, log_dir)
            for folder in (mine, mine.parent):
                if not any(folder.iterdir()):
                    folder.rmdir()
            notes.append(f"the logs of run {run_id} are back from {mine}")
    log_dir.mkdir(parents=True, exist_ok=True)
    tmp = owner_file.with_suffix(".tmp")
    tmp.write_text(json.dumps({"run_id": run_id}) + "\n")
    os.replace(tmp, owner_file)
    return notes


def _owner(owner_file: Path) -> str | None:
    """The run id in ``run.json``; None when there is none or it cannot be read (then the logs have no owner)."""
    try:
        owner = json.loads(owner_file.read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return owner if isinstance(owner, str) and owner and "/" not in owner else None


def _move(files: list[Path], src: Path, dst: Path) -> None:
    for path in files:
        target = dst / path.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, target)
    for folder in sorted({p.parent for p in files}, reverse=True):  # folders the move emptied
        while folder != src and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
            folder = folder.parent


def _names(files: list[Path], root: Path) -> list[str]:
    """metrics.jsonl, rollouts/ (3 files): short enough for one line."""
    counts: dict[str, int] = {}
    for path in files:
        rel = path.relative_to(root)
        key = str(rel) if len(rel.parts) == 1 else rel.parts[0] + "/"
        counts[key] = counts.get(key, 0) + 1
    return [name if n == 1 and not name.endswith("/") else f"{name} ({n} files)" for name, n in counts.items()]


def _stamp(files: list[Path]) -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.localtime(max(p.stat().st_mtime for p in files)))


def _unused(folder: Path) -> Path:
    candidate, n = folder, 1
    while candidate.exists():
        candidate, n = folder.with_name(f"{folder.name}-{n}"), n + 1
    return candidate
