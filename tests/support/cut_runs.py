"""A whole run in a subprocess whose output is captured: when it outlasts its time, what it printed is printed
before the test fails (a GPU stage cut at its limit otherwise returns nothing of the run)."""

from __future__ import annotations

import subprocess


def run_printing(cmd: list[str], *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)``; on a timeout the
    tails of the run's stdout and stderr are printed, then the timeout is raised."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
    except subprocess.TimeoutExpired as err:
        for part in (err.stdout, err.stderr):
            text = part.decode(errors="replace") if isinstance(part, bytes) else (part or "")
            print(text[-6000:])
        raise
