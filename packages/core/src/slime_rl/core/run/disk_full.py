"""A full disk during a checkpoint save, said as one line: which folder, how much to free, where else to
save; the partial step folder removed (a full disk had left 1 GB of it, and 85 lines of torch's
``enforce fail`` errors that never said "no space").

torch's writer turns ENOSPC into ``RuntimeError: [enforce fail ...] unexpected pos``, the OSError only
in its ``__context__``, which pickling drops: so each trainer rank names it where it happens
(`named_in`, around its save, and the Megatron trainer's writer around each write, before torch hands the
error to the other ranks), and the driver (`save_guard`, around the whole save) also reads the messages and,
for an error that says nothing, how full the disk is."""

from __future__ import annotations

import contextlib
import errno
import shutil
from collections.abc import Iterator
from pathlib import Path

from slime_rl.core.config import RunFailedError

_NO_SPACE_TEXT = ("No space left on device", f"[Errno {errno.ENOSPC}]", "no space left on device writing")
_NEARLY_FULL = 0.005  # of the disk: below this much free, a save that failed is taken to have filled it


class DiskFullError(RunFailedError):
    """No space left on device while writing a checkpoint (one line; exit 1)."""


def no_space_in(err: BaseException) -> bool:
    """Whether ``err`` is, wraps or was raised while handling ENOSPC: its cause and context chain,
    Ray's ``cause``, torch's CheckpointException ``failures`` (rank -> (error, trace)), and the text."""
    seen: set[int] = set()
    todo: list[object] = [err]
    while todo:
        item = todo.pop()
        if not isinstance(item, BaseException) or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, DiskFullError) or (isinstance(item, OSError) and item.errno == errno.ENOSPC):
            return True
        if any(text in str(item) for text in _NO_SPACE_TEXT):
            return True
        todo += [item.__cause__, item.__context__, getattr(item, "cause", None), *item.args]
        failures = getattr(item, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) and f else f for f in failures.values()]
    return False


@contextlib.contextmanager
def named_in(path: str) -> Iterator[None]:
    """In a trainer rank, around its save: ENOSPC leaves as DiskFullError naming ``path`` (it pickles
    whole, where torch's error loses the OSError on the way to the driver)."""
    try:
        yield
    except BaseException as err:  # torch's CheckpointException is a BaseException
        if isinstance(err, DiskFullError) or not no_space_in(err):
            raise
        raise DiskFullError(f"no space left on device writing {path}") from None


@contextlib.contextmanager
def save_guard(folder: Path, save_dir: Path) -> Iterator[None]:
    """Around a whole save into the step folder ``folder``: a full disk removes ``folder`` (it is not
    committed; what is, stays) and leaves as one DiskFullError line saying how much to free."""
    try:
        yield
    except BaseException as err:
        if not (no_space_in(err) or (isinstance(err, Exception) and _nearly_full(save_dir))):
            raise
        written = _bytes_under(folder)
        shutil.rmtree(folder, ignore_errors=True)
        (save_dir / "latest.tmp").unlink(missing_ok=True)
        last_checkpoint_bytes = _committed_bytes(save_dir)  # what one checkpoint takes, when one was saved
        needed = max(last_checkpoint_bytes or 0, written)
        free = shutil.disk_usage(save_dir).free if save_dir.is_dir() else 0
        to_free = needed - free if needed > free else needed
        what = "" if last_checkpoint_bytes else "at least "  # the first save: only what it got to write
        raise DiskFullError(f"no space left on device writing {folder}; free {what}{human_bytes(to_free)} or point"
                            f" checkpoint.save_dir elsewhere (the partial {folder.name} was removed; the checkpoints"
                            " committed before are intact)") from None


def _committed_bytes(save_dir: Path) -> int | None:
    """The size of the checkpoint ``latest`` names (its meta.json's files); None without a readable one."""
    from slime_rl.core.run import checkpoint  # (checkpoint imports nothing of this module's)

    try:
        found = checkpoint.latest(save_dir)
    except (OSError, ValueError):  # CheckpointError is a ValueError
        return None
    files = found[1].get("files") if found is not None else None
    if not isinstance(files, dict):
        return None
    return sum(f.get("bytes", 0) for f in files.values() if isinstance(f, dict) and isinstance(f.get("bytes"), int))


def _nearly_full(save_dir: Path) -> bool:
    try:
        usage = shutil.disk_usage(save_dir)
    except OSError:
        return False
    return usage.free < usage.total * _NEARLY_FULL


def _bytes_under(folder: Path) -> int:
    total = 0
    for path in folder.rglob("*"):
        with contextlib.suppress(OSError):
            if path.is_file():
                total += path.stat().st_size
    return total


def human_bytes(count: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if count < 1000:
            return f"{count:.0f} {unit}" if unit == "bytes" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} TB"
