"""Checkpoint folders: ``<save_dir>/step_<k>/`` plus a ``latest`` pointer written last.

A checkpoint counts only once its ``meta.json`` exists and ``latest`` names it, so
a run killed mid-save resumes from the previous, complete one. ``meta.json`` lists
every file of the folder with its size and CRC-32, and carries a checksum of its
own content: a resume verifies all of them (and that no pickle in the folder asks
for more than plain data and tensors, see `safe_pickle`) before anything loads.

A run writes only into step folders it created: `prepare` makes the folder and its ``owner.json``
(the run id) or refuses one another run (or no run) made; `commit` certifies a folder only for
the run named there, and prunes only that run's older checkpoints.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from slime_rl.core.config import CheckpointError  # beside ConfigError, below this module and safe_pickle
from slime_rl.core.run import checkpoint_contents

_STEP_NAME = re.compile(r"step_\d{6,}")
OWNER_FILE = "owner.json"  # in a step folder: the run that made it
_CHUNK = 8 << 20


def step_dir(save_dir: str | Path, step: int) -> Path:
    return Path(save_dir) / f"step_{step:06d}"


def folder_owner(folder: Path) -> str | None:
    """The run that created a step folder: its ``owner.json``, else (a checkpoint from before owner
    files) its meta.json's run id; None when neither names one."""
    for name in (OWNER_FILE, "meta.json"):
        try:
            owner = json.loads((folder / name).read_bytes()).get("run_id")
        except (OSError, ValueError, AttributeError):
            continue
        return owner if isinstance(owner, str) and owner else None
    return None


def prepare(save_dir: str | Path, step: int, run_id: str | None = None) -> Path:
    """The folder to write step ``step`` into: a new one, marked as this run's; or one this run made
    before (a save that did not finish, a step saved again after a resume), which loses its
    ``meta.json`` first: until this run commits it, it is not a checkpoint. A folder another run or
    no run made is refused (CheckpointError): this run neither writes into it nor certifies its files.
    (``run_id`` None: a folder of no run's, as tools and tests write one, for a commit without a run id.)"""
    folder = step_dir(save_dir, step)
    try:
        folder.mkdir(parents=True)
    except FileExistsError:
        owner = None if folder.is_symlink() else folder_owner(folder)
        if owner != run_id:
            made_by = f"run {owner}" if owner else "no slime-rl run (it has no owner.json)"
            raise CheckpointError(str(folder), f"was made by {made_by}, not by this run ({run_id}); move it out"
                                  f" of {Path(save_dir)} or give this run another checkpoint.save_dir") from None
        (folder / "meta.json").unlink(missing_ok=True)
    else:
        if run_id is not None:
            write_json_atomic(folder / OWNER_FILE, {"run_id": run_id})
    return folder


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def file_crc32(path: Path) -> str:
    """CRC-32 of a file, streamed (zlib releases the GIL; ~0.5-1.5 GB/s here). A check against
    damage, not a signature: `safe_pickle` is what keeps a crafted checkpoint from running code."""
    crc, buffer = 0, bytearray(_CHUNK)
    view = memoryview(buffer)
    with path.open("rb", buffering=0) as f:
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def _crc32s(paths: list[Path]) -> list[str]:
    """`file_crc32` of each path, several files at once (one per trainer rank's shard)."""
    if len(paths) <= 1:
        return [file_crc32(p) for p in paths]
    with ThreadPoolExecutor(max_workers=min(len(paths), os.cpu_count() or 1)) as pool:
        return list(pool.map(file_crc32, paths))


def _content_checksum(meta: dict[str, Any]) -> str:
    body = {k: v for k, v in meta.items() if k != "checksum"}
    return f"{zlib.crc32(json.dumps(body, sort_keys=True).encode()):08x}"


def _listing(folder: Path) -> list[Path]:
    """Every file under ``folder`` but meta.json, as relative paths."""
    return sorted(p.relative_to(folder) for p in folder.rglob("*")
                  if p.is_file() and p.relative_to(folder) != Path("meta.json"))


def commit(save_dir: str | Path, step: int, meta: dict[str, Any], keep_last: int | None = None,
           needs: tuple[str, ...] = ()) -> Path:
    """Mark ``step_dir(step)`` complete and point ``latest`` at it; prune old ones.

    Only a complete folder (checkpoint_contents.py: the folders in ``needs``, each distributed
    checkpoint's index and shards) is committed; else CheckpointError, and ``latest`` stays.
    meta.json gets the size and CRC-32 of every file the folder holds now (the trainer ranks
    have written theirs) and a checksum of its own content."""
    folder = step_dir(save_dir, step)
    if missing := checkpoint_contents.missing_files(folder, needs):
        raise CheckpointError(str(folder / missing[0]), f"is missing, so step {step} is not committed (the save did"
                              " not write it, or something removed it: another run writing this save_dir?); latest"
                              f" still names {latest_name(save_dir)}")
    run_id = meta.get("run_id")
    if folder_owner(folder) != run_id:  # certify only a folder this run made (see prepare)
        raise CheckpointError(str(folder), f"was made by run {folder_owner(folder)}, not by the run committing it"
                              f" ({run_id}); a run commits only step folders it made")
    listing = _listing(folder)
    files = {p.as_posix(): {"bytes": (folder / p).stat().st_size, "crc32": crc}
             for p, crc in zip(listing, _crc32s([folder / p for p in listing]), strict=True)}
    record = {"step": step, **meta, "files": files}
    record["checksum"] = _content_checksum(record)
    write_json_atomic(folder / "meta.json", record)
    latest_file = Path(save_dir) / "latest"
    tmp = latest_file.with_suffix(".tmp")
    tmp.write_text(folder.name)
    os.replace(tmp, latest_file)
    if keep_last:
        # Only this run's past: the folder may hold another run's checkpoints (a resume from a
        # copy, a user's own), and a later step of this run's own is not older than this one.
        done = sorted(p for p in Path(save_dir).glob("step_*")
                      if (p / "meta.json").exists() and (k := _step_of(p)) is not None and k <= step
                      and not p.is_symlink() and folder_owner(p) == run_id)
        for old in done[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return folder


def _step_of(folder: Path) -> int | None:
    try:
        return int(folder.name.removeprefix("step_"))
    except ValueError:
        return None


def earlier_run(save_dir: str | Path) -> str | None:
    """What makes ``save_dir`` an earlier run's, for a fresh run to refuse it: its ``latest``, else
    its step folders (a run whose ``latest`` was removed); None when it holds neither."""
    previous = latest_name(save_dir)
    if previous is not None:
        return f"latest: {previous}"
    steps = sorted(p.name for p in Path(save_dir).glob("step_*"))
    if steps:
        return f"{', '.join(steps[-3:])}{' ...' if len(steps) > 3 else ''}, without a latest"
    return None


def check_steps_ahead(save_dir: str | Path, step: int, run_id: str | None) -> None:
    """Before a resume from ``step`` starts: every step folder it may write into later is one this run
    made (see prepare), so that it is refused now, in one line, not at the save after hours of training.
    (``run_id`` None: a checkpoint from before run ids, resumed under a new one, which made none.)"""
    for folder in sorted(Path(save_dir).glob("step_*")):
        later = (_step_of(folder) or 0) > step
        if later and (folder.is_symlink() or run_id is None or folder_owner(folder) != run_id):
            owner = None if folder.is_symlink() else folder_owner(folder)
            made_by = f"run {owner}" if owner else "no slime-rl run (it has no owner.json)"
            raise CheckpointError(str(folder), f"was made by {made_by}, not by the run resumed ({run_id}), and this"
                                  f" run would save into it; move it out of {Path(save_dir)}")


def latest_name(save_dir: str | Path) -> str | None:
    """What ``<save_dir>/latest`` says (whether or not that checkpoint is usable); None without one."""
    pointer = Path(save_dir) / "latest"
    if not pointer.exists():
        return None
    try:
        return pointer.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return "(unreadable)"


def latest(save_dir: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint and its meta; None when ``save_dir`` has none (no ``latest``).

    Raises CheckpointError when ``latest`` names a folder that is gone or whose meta.json is
    missing or damaged: that is not "no checkpoint", and a resume must not start over."""
    save_dir = Path(save_dir)
    name = latest_name(save_dir)
    if name is None:
        return None
    folder = save_dir / name
    if not _STEP_NAME.fullmatch(name) or not folder.is_dir():
        raise CheckpointError(str(save_dir / "latest"),
                              f"names {name[:40]!r}, which is not a checkpoint folder in {save_dir}" + _way_on(save_dir))
    meta_file = folder / "meta.json"
    if not meta_file.is_file():
        raise CheckpointError(str(meta_file), "is missing: the save of this step did not finish" + _way_on(save_dir, name))
    try:
        meta = json.loads(meta_file.read_bytes())
    except (OSError, ValueError) as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CheckpointError(str(meta_file), f"is damaged (not JSON: {err})" + _way_on(save_dir, name)) from None
    if not isinstance(meta, dict) or meta.get("checksum") != _content_checksum(meta) or meta.get("step") != _step_of(folder):
        raise CheckpointError(str(meta_file), "is damaged (its content does not match its checksum)"
                              + _way_on(save_dir, name))
    return folder, meta


def verify(folder: Path, meta: dict[str, Any]) -> None:
    """Every file of the checkpoint is there with the size and CRC-32 written at commit, no other
    file is, and every pickle in it holds only plain data and tensors; else CheckpointError."""
    # Here, not at the top: safe_pickle imports torch, which only a resume needs (not slime-cli's progress).
    from slime_rl.core.infra import safe_pickle

    save_dir, broken = folder.parent, folder.name
    files = meta.get("files")
    if not (isinstance(files, dict) and all(isinstance(want, dict) for want in files.values())):
        raise CheckpointError(str(folder / "meta.json"), "lists no files with checksums (written by an older"
                              " slime-rl?), so the checkpoint cannot be checked" + _way_on(save_dir, broken))
    listed = {Path(name) for name in files}
    if any(Path(name).is_absolute() or ".." in Path(name).parts for name in files):
        raise CheckpointError(str(folder / "meta.json"), "lists files outside its folder; it was not written by"
                              " slime-rl" + _way_on(save_dir, broken))
    for rel in _listing(folder):
        if rel not in listed:
            raise CheckpointError(str(folder / rel), "is not one of the files written with this checkpoint (meta.json"
                                  " does not list it); remove it if you put it there")
    for name, want in files.items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(str(path), "is missing from the checkpoint" + _way_on(save_dir, broken))
        size = path.stat().st_size
        if size != want.get("bytes"):
            raise CheckpointError(str(path), f"is damaged: {size} bytes, {want.get('bytes')} when written at step"
                                  f" {meta['step']}" + _way_on(save_dir, broken))
    for (name, want), crc in zip(files.items(), _crc32s([folder / name for name in files]), strict=True):
        path = folder / name
        if crc != want.get("crc32"):
            raise CheckpointError(str(path), f"is damaged: its CRC-32 differs from the one written at step"
                                  f" {meta['step']}" + _way_on(save_dir, broken))
    if missing := checkpoint_contents.missing_files(folder):  # meta.json vouches only for what it lists
        raise CheckpointError(str(folder / missing[0]), "is missing: the checkpoint was committed incomplete"
                              + _way_on(save_dir, broken))
    for metadata_file in sorted(folder.rglob(".metadata")):
        safe_pickle.check_dcp_folder(metadata_file.parent)


def resume_point(save_dir: str | Path) -> tuple[Path, dict[str, Any]]:
    """The checkpoint ``checkpoint.resume`` continues from, verified; CheckpointError saying what
    was found and the way on when there is none or it is damaged."""
    save_dir = Path(save_dir)
    found = latest(save_dir)
    if found is None:
        complete = sorted(p.name for p in save_dir.glob("step_*") if (p / "meta.json").is_file())
        if complete:  # the pointer was removed: which one to trust is the user's call
            raise CheckpointError(str(save_dir / "latest"), f"is missing, though complete checkpoints are here"
                                  f" ({', '.join(complete[-3:])}); to resume from one, write its folder name into it")
        partial = sorted(p.name for p in save_dir.glob("step_*") if p.is_dir())
        seen = (f" ({', '.join(partial)} without meta.json: saves that did not finish)" if partial
                else "" if save_dir.is_dir() else " (the folder does not exist)")
        raise CheckpointError("checkpoint.resume", f"{save_dir} holds no checkpoint to resume from{seen}; start again"
                              " without --resume (checkpoint.resume=false): the run starts at step 0 and the data"
                              " from the beginning")
    verify(*found)
    return found


def _way_on(save_dir: Path, broken: str | None = None) -> str:
    """The fix: resume from an older complete checkpoint, or start afresh elsewhere."""
    complete = sorted(p.name for p in save_dir.glob("step_*") if (p / "meta.json").is_file() and p.name != broken)
    older = (f"; to resume from an older checkpoint, write its folder name ({', '.join(complete[-3:])}) into"
             f" {save_dir / 'latest'}" if complete else "")
    return f"{older}; to start afresh, run without --resume and with another checkpoint.save_dir"
