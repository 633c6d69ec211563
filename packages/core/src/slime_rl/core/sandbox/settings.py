"""What one sandboxed call may use: the ``rollout.sandbox.*`` keys as a plain dataclass, so that
callers outside the config (the agent's tools, a benchmark, a test) build one directly."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

MIB = 2**20


def default_python() -> str:
    """The interpreter the code runs under: this one's base interpreter (outside any venv, so the
    code sees the standard library and the base site-packages, never this project's venv)."""
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    return str(base) if base.exists() else os.path.realpath(sys.executable)


def default_concurrency() -> int:
    """One call per core, at most 32. A call is short and part of its time is process start-up, not
    CPU: on the 2-core machine, 2 at once kept a rollout step with 64 queued calls at 1.48x the step
    without tool cost, 1 at once at 2.57x (benchmarks/sandbox_concurrency.py)."""
    return max(1, min(os.cpu_count() or 1, 32))


@dataclass(frozen=True)
class SandboxSettings:
    timeout_s: float = 10.0  # wall clock per call
    cpu_time_s: int = 10  # CPU seconds per call (RLIMIT_CPU)
    memory_mb: int = 1024  # address space (RLIMIT_AS)
    file_size_mb: int = 16  # largest file the code may write (RLIMIT_FSIZE)
    scratch_mb: int = 64  # size of the tmpfs scratch directory, the only writable place
    max_processes: int = 16  # processes and threads of the call's uid (RLIMIT_NPROC)
    max_open_files: int = 64  # RLIMIT_NOFILE
    max_output_bytes: int = 65536  # per stream; past it the call is killed and the output marked truncated
    max_concurrency: int | None = None  # calls at once in this process; None: default_concurrency()
    require_isolation: bool = False  # refuse to run without namespaces (see isolation.py)
    python: str | None = None  # interpreter for the code; None: default_python()
    readonly_paths: tuple[str, ...] = ()  # extra host paths visible read-only (e.g. a venv with numpy)
    env: dict[str, str] = field(default_factory=dict)  # the code's extra environment variables
    uid_base: int = 200_000  # calls run as uids uid_base, uid_base + 1, ... (one per call in flight)

    @property
    def concurrency(self) -> int:
        return self.max_concurrency if self.max_concurrency is not None else default_concurrency()

    @property
    def interpreter(self) -> str:
        return self.python or default_python()

    @classmethod
    def from_section(cls, section: Any) -> SandboxSettings:
        """From a ``rollout.sandbox`` section (pydantic model or dict)."""
        values = section if isinstance(section, dict) else section.model_dump()
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in values.items() if k in known}
        if "readonly_paths" in kwargs:
            kwargs["readonly_paths"] = tuple(kwargs["readonly_paths"])
        return cls(**kwargs)

    @classmethod
    def from_config(cls, cfg: Any) -> SandboxSettings:
        """From the whole run config: reads ``cfg.rollout.sandbox``."""
        return cls.from_section(cfg.rollout.sandbox)
