"""What a run owns in its ``logging.dir``, so that a new run never consumes, mixes with or deletes an earlier one's.

A run gets an id when it starts afresh; every checkpoint's meta records it, so a resumed run is the same run.

- Rollout state (the buffer's SQLite file of scored and partial groups): ``rollout_state/<run id>/``. A fresh
  run starts with an empty buffer and never opens another run's, which stays where it is.
- Logs (``metrics.jsonl``, ``rollouts/step_*.jsonl``, TensorBoard events) belong to the run named in ``run.json``,
  which proves which ones it wrote: it lists each log file by identity (device and inode; `record_logs` after
  every step) and the time the run first started. A file it does not list counts as the run's only if it
  changed after that time and was not there when the run began (``left_alone``: the names it found then). A
  run that finds another run's proven logs moves them to ``earlier_runs/<that run's id>/`` (with their record)
  and says so; a resumed run whose logs were moved aside that way gets them back.
- Anything else is left where it is. A file no run proves whose name this run would write again
  (``metrics.jsonl``, ``rollouts/step_*.jsonl``), or a log name that is a symlink, is refused in one line
  (ConfigError naming it and the fix). A ``run.json`` from before these records (a run id only) vouches for
  the logs beside it, as it did then.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

OWNER_FILE = "run.json"
EARLIER_RUNS = "earlier_runs"
# What a run writes into logging.dir, as globs relative to it; nothing else there is touched.
LOG_ARTIFACTS = ("metrics.jsonl", "rollouts/step_*.jsonl", "tensorboard/events.out.tfevents.*")
# Names a run writes again: another's file there would be appended to or overwritten.
WRITTEN_AGAIN = ("metrics.jsonl", "rollouts/step_*.jsonl")


def new_run_id() -> str:
    """Sortable by start time, unique across runs started in the same second."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def rollout_state_dir(log_dir: str | Path, run_id: str) -> Path:
    return Path(log_dir) / "rollout_state" / run_id


def log_artifacts(log_dir: Path) -> list[Path]:
    """The files in ``log_dir`` named like a run's logs (symlinks too: they are refused, never followed)."""
    return sorted(p for pattern in LOG_ARTIFACTS for p in log_dir.glob(pattern) if p.is_file() or p.is_symlink())


@dataclass
class RunRecord:
    """``run.json``: the run and the log files it wrote (see the module docstring)."""

    run_id: str | None
    files: dict[str, list[int]] = field(default_factory=dict)  # relative path -> [st_dev, st_ino]
    started_ns: int | None = None  # when the run first started; None: a run.json from before records
    left_alone: list[str] = field(default_factory=list)  # log files that were there before it started

    def proves(self, folder: Path, path: Path) -> bool:
        """Whether ``path`` (a log file in ``folder``) is one this run wrote."""
        rel = _rel(path, folder)
        if self.run_id is None or rel in self.left_alone or not _plainly_inside(folder, path):
            return False
        if self.started_ns is None:
            return True  # an old run.json: its logs are its run's, as they were then
        if rel in self.files:
            return _identity(path) == self.files[rel]
        return path.lstat().st_mtime_ns >= self.started_ns  # written after it started, before it recorded it


def read_record(folder: str | Path) -> RunRecord:
    """``folder``'s run.json; a record of no run when there is none or it cannot be read."""
    try:
        data = json.loads((Path(folder) / OWNER_FILE).read_text())
        run_id = data.get("run_id")
    except (OSError, ValueError, AttributeError):
        return RunRecord(None)
    if not (isinstance(run_id, str) and run_id and "/" not in run_id):
        return RunRecord(None)
    files = data.get("files") if isinstance(data.get("files"), dict) else {}
    started = data.get("started_ns")
    left_alone = data.get("left_alone") if isinstance(data.get("left_alone"), list) else []
    return RunRecord(run_id, {k: v for k, v in files.items() if isinstance(v, list)},
                     started if isinstance(started, int) else None, [n for n in left_alone if isinstance(n, str)])


def proven_logs(folder: str | Path) -> list[Path]:
    """The log files in ``folder`` that the run named in its run.json wrote."""
    folder = Path(folder)
    record = read_record(folder)
    return [p for p in log_artifacts(folder) if record.proves(folder, p)]


def claim_logging_dir(log_dir: str | Path, run_id: str, *, resuming: bool) -> list[str]:
    """Make ``log_dir``'s logs this run's (see the module docstring); returns what was moved, as messages.
    Raises ConfigError naming a file this run would write over that no run proves it wrote."""
    from slime_rl.core.config import ConfigError  # here: the config package is not needed to read a record

    log_dir = Path(log_dir)
    record = read_record(log_dir)
    notes: list[str] = []
    mine: Path | None = None  # where a later run set this run's logs aside
    if record.run_id == run_id:  # its own folder: what it proves stays its own
        own = [p for p in log_artifacts(log_dir) if record.proves(log_dir, p)]
        started = record.started_ns or time.time_ns()
    elif record.run_id is None and resuming and not (log_dir / OWNER_FILE).exists():
        own = [p for p in log_artifacts(log_dir) if _plainly_inside(log_dir, p)]  # logs from before run ids
        started = time.time_ns()
    else:
        proven = [p for p in log_artifacts(log_dir) if record.proves(log_dir, p)]
        if proven:
            aside = _unused(log_dir / EARLIER_RUNS / str(record.run_id))
            _move(proven, log_dir, aside)
            moved = [aside / p.relative_to(log_dir) for p in proven]
            # every file moved is listed; one that shows up there later is no run's
            _write(aside, RunRecord(record.run_id, {_rel(p, aside): _identity(p) or [] for p in moved},
                                    time.time_ns()))
            notes.append(f"logging.dir {log_dir} held the logs of an earlier run ({', '.join(_names(proven, log_dir))});"
                         f" moved them to {aside}")
        own, mine, started = [], log_dir / EARLIER_RUNS / run_id, time.time_ns()
    foreign = [p for p in log_artifacts(log_dir) if p not in own]
    for path in foreign:
        if not _plainly_inside(log_dir, path) or any(path.relative_to(log_dir).match(g) for g in WRITTEN_AGAIN):
            raise ConfigError("logging.dir", f"{path} is not a log that this run or an earlier one proves it wrote"
                              f" (no run.json lists it), and this run would write over it; move it out of {log_dir},"
                              " or give this run another logging.dir")
    if resuming and mine is not None and mine.is_dir():
        back = proven_logs(mine)
        _move(back, mine, log_dir)
        own += [log_dir / p.relative_to(mine) for p in back]
        (mine / OWNER_FILE).unlink(missing_ok=True)
        for folder in (mine, mine.parent):
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
        notes.append(f"the logs of run {run_id} are back from {mine}")
    log_dir.mkdir(parents=True, exist_ok=True)
    _write(log_dir, RunRecord(run_id, {_rel(p, log_dir): _identity(p) or [] for p in own}, started,
                              sorted(_rel(p, log_dir) for p in foreign)))
    return notes


def record_logs(log_dir: str | Path) -> None:
    """List in run.json the log files the run has written since it last did (the driver calls this after
    every step), so that a later run can tell them from files put there by anyone else."""
    log_dir = Path(log_dir)
    record = read_record(log_dir)
    if record.run_id is None or record.started_ns is None:
        return
    seen = {_rel(p, log_dir): _identity(p) for p in log_artifacts(log_dir)
            if _rel(p, log_dir) not in record.left_alone and _plainly_inside(log_dir, p)}
    changed = {rel: ident for rel, ident in seen.items() if ident is not None and record.files.get(rel) != ident}
    if changed:
        _write(log_dir, RunRecord(record.run_id, {**record.files, **changed}, record.started_ns, record.left_alone))


def _write(folder: Path, record: RunRecord) -> None:
    """run.json, whole (a temporary file of a name no one else's file has, then a rename)."""
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{OWNER_FILE}.")
    with os.fdopen(fd, "w") as f:
        json.dump({"run_id": record.run_id, "started_ns": record.started_ns, "left_alone": record.left_alone,
                   "files": record.files}, f)
    os.replace(tmp, folder / OWNER_FILE)


def _identity(path: Path) -> list[int] | None:
    """[device, inode] of a plain file (not through a symlink); None for anything else."""
    try:
        st = path.lstat()
    except OSError:
        return None
    return [st.st_dev, st.st_ino] if stat.S_ISREG(st.st_mode) else None


def _plainly_inside(folder: Path, path: Path) -> bool:
    """``path`` is a plain file under ``folder`` with no symlink on the way: acting on it stays inside."""
    try:
        inside = path.parent.resolve() == folder.resolve() / path.parent.relative_to(folder)
    except (OSError, ValueError):
        return False
    return inside and _identity(path) is not None


def _rel(path: Path, folder: Path) -> str:
    return path.relative_to(folder).as_posix()


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


def _unused(folder: Path) -> Path:
    candidate, n = folder, 1
    while candidate.exists():
        candidate, n = folder.with_name(f"{folder.name}-{n}"), n + 1
    return candidate
