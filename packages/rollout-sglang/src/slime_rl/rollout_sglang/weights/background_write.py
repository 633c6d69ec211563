"""Folders that only a restarted server reads (the restore copy of the weights, each adapter's PEFT folder),
written in a background thread so that a weight sync does not wait for the disk.

One write at a time: the next one waits for the last. A failed write does not fail the run (only a restart
needs the folder): the next write logs it. A reader waits for the folder to be renamed into place.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)


class BackgroundWrite:
    """``what`` and ``consequence`` say, in the warning, what failed and what that leaves broken."""

    def __init__(self, what: str, consequence: str):
        self.what, self.consequence = what, consequence
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # the last write's failure, logged by the next `start`

    def start(self, write: Callable[[], None], *, name: str) -> None:
        """Run ``write`` in a thread once the last write is done."""
        self.wait()
        self.report()
        self._thread = threading.Thread(target=self._run, args=(write,), daemon=True, name=name)
        self._thread.start()

    def _run(self, write: Callable[[], None]) -> None:
        try:
            write()
        except BaseException as err:  # reported by the next write; a restart that needs the folder says so
            self.error = err

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def report(self) -> None:
        """Log the last write's failure, once."""
        if self.error is not None:
            logger.warning("writing %s failed (%s): %s", self.what, self.error, self.consequence)
            self.error = None


def wait_for_folder(folder: Path, timeout: float) -> Path | None:
    """``folder`` once a background write has renamed it into place; None if not within ``timeout``."""
    deadline = time.monotonic() + timeout
    while not folder.is_dir():
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.1)
    return folder
