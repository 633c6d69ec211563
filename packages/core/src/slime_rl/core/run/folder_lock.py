"""One run per folder: a run holds an flock on ``<folder>/.slime-rl.lock`` in every folder it writes
(`run_folders`: its ``logging.dir``, which holds its rollout state and the engines' weight folders, and
its ``checkpoint.save_dir``), so a second run on one of them is refused before anything starts, naming
the first (pid, host, start time, command, from the owner record in the same file).

The kernel drops an flock when its holder dies, SIGKILL included: a lock file left behind is no lock,
and no liveness guess (a pid, across pid namespaces) is needed. Claims are per process and counted:
slime-cli claims a folder before it touches it, `loop.train` claims it again for the run; the lock
goes with the last release, or at exit. Standard library only: slime-cli's driver claims before any
backend or Ray is imported.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import fcntl
import json
import os
import shlex
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from slime_rl.core.config.errors import ConfigError

if TYPE_CHECKING:
    from slime_rl.core.config import Config

LOCK_FILE = ".slime-rl.lock"


@dataclass
class _Held:
    fd: int
    lock_file: Path
    claims: int


_held: dict[str, _Held] = {}  # realpath of a folder -> this process's lock on it


def run_folders(cfg: Config) -> dict[str, Path]:
    """The folders a run writes, by the field that names them. The rest live inside these (rollout
    state, ``sglang/weights``) or are private to the process (leftovers.py: Ray's, the weight buckets)."""
    return {"logging.dir": Path(cfg.logging.dir), "checkpoint.save_dir": cfg.checkpoint_dir}


def claim(field: str, folder: str | Path) -> None:
    """Hold ``folder`` (created when missing) for this process, or ConfigError naming ``field`` and the
    run that holds it. Claiming a folder this process holds counts one more claim."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(field, f"{folder} cannot be created ({err.strerror}); give a folder this user can"
                                 " write") from None
    key = os.path.realpath(folder)
    if key in _held:
        _held[key].claims += 1
        return
    lock_file = Path(key) / LOCK_FILE
    while True:
        try:
            fd = os.open(lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as err:
            raise ConfigError(field, f"{folder} is not writable ({err.strerror}); give a folder this user can"
                                     " write") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(field, f"{folder} is in use by another run ({_describe_owner(lock_file)}); wait"
                                     f" for it to end, or give this run another {field}") from None
        except OSError as err:  # a filesystem without locks (some NFS setups): the run goes on, unguarded
            print(f"slime-rl: warning: {field}: {folder} takes no file locks ({err.strerror}), so another run"
                  " using it at the same time is not refused", file=sys.stderr, flush=True)
            break
        # A holder that released unlinks the file: a lock on an unlinked file guards nothing, so retry.
        try:
            same = os.stat(lock_file).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(_owner_record()) + "\n").encode(), 0)
    _held[key] = _Held(fd, lock_file, 1)


def claim_run_folders(cfg: Config, *, existing_only: bool = False) -> None:
    """`claim` each of `run_folders` (with ``existing_only``, only those that exist: slime-cli's early
    claim, which must not create a folder for a run that may still be refused)."""
    for field, folder in run_folders(cfg).items():
        if not existing_only or folder.is_dir():
            claim(field, folder)


def release(folder: str | Path) -> None:
    """One claim fewer on ``folder``; the last removes the lock file and unlocks it."""
    key = os.path.realpath(folder)
    held = _held.get(key)
    if held is None:
        return
    held.claims -= 1
    if held.claims > 0:
        return
    del _held[key]
    with contextlib.suppress(OSError):
        held.lock_file.unlink()  # while still locked: a waiting claimer sees the inode change and retries
    os.close(held.fd)


@contextlib.contextmanager
def claims_released() -> Iterator[None]:
    """Release, when the block ends, every claim made inside it (`loop.train`: a run's folders are
    free once it ends, however it ends)."""
    before = {key: held.claims for key, held in _held.items()}
    try:
        yield
    finally:
        for key in list(_held):
            for _ in range(_held[key].claims - before.get(key, 0)):
                release(key)


def held_folders() -> list[Path]:
    return [Path(key) for key in _held]


def _release_all() -> None:
    for key in list(_held):
        _held[key].claims = 1
        release(key)


atexit.register(_release_all)


def _owner_record() -> dict[str, object]:
    # The command without its KEY=VALUE overrides: one may hold a credential (a URL's), and this file
    # and the refusal that quotes it are not the place for one.
    command = [Path(sys.argv[0]).name, *(arg for arg in sys.argv[1:] if "=" not in arg)] if sys.argv else []
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "started": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
            "command": shlex.join(command)[:200]}


def _describe_owner(lock_file: Path) -> str:
    """``pid 123 on host, started ... UTC: slime-cli train x.yaml``, from the holder's owner record
    (retried briefly: the holder writes it just after it takes the lock)."""
    for _ in range(10):
        try:
            record = json.loads(lock_file.read_text())
            return (f"pid {record['pid']} on {record['host']}, started {record['started']}"
                    + (f": {record['command']}" if record.get("command") else ""))
        except (OSError, ValueError, KeyError, TypeError):
            time.sleep(0.05)
    return f"its owner record in {lock_file} is unreadable"
