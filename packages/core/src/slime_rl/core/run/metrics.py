"""Per-step metrics to JSONL, TensorBoard (when installed) and wandb (when configured).

metrics.jsonl holds one row per step: a second `log` for the step just written (the eval that
closes a run) merges into its row, and a run resumed from step k first drops the rows its dead
run wrote after step k (the resumed run writes them again).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def phase(timings: dict[str, float], name: str) -> Iterator[None]:
    """``with phase(timings, "train"):`` records the block's seconds as ``timings["time/train"]``."""
    start = time.perf_counter()
    yield
    timings[f"time/{name}"] = time.perf_counter() - start


class BusyClock:
    """Seconds during which at least one piece of work ran: overlapping work counts once. The
    rollout runner holds one around every sample's generation (``rollout/engine_busy_total_s``)."""

    def __init__(self) -> None:
        self.running = 0
        self._total_s = 0.0
        self._since = 0.0

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        if self.running == 0:
            self._since = time.perf_counter()
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            if self.running == 0:
                self._total_s += time.perf_counter() - self._since

    def seconds(self) -> float:
        """Busy seconds so far, the current stretch included."""
        return self._total_s + (time.perf_counter() - self._since if self.running else 0.0)


class MetricsLogger:
    def __init__(self, log_dir: str | Path, *, tensorboard: bool = True, wandb_project: str | None = None,
                 config: dict[str, Any] | None = None, resume_step: int | None = None):
        self.dir = Path(log_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.dir / "metrics.jsonl"
        # (step, byte offset, row) of the file's last row: a later log of that step rewrites it
        self._last: tuple[int, int, dict[str, Any]] | None = None
        if resume_step is not None:
            self._last = keep_rows_up_to(self.jsonl_path, resume_step)
        self._jsonl = self.jsonl_path.open("ab", buffering=0)
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional; JSONL always works
                pass
            else:
                self._tb = SummaryWriter(str(self.dir / "tensorboard"))
        self._wandb = None
        if wandb_project:
            import wandb  # asked for explicitly: a missing package is the user's to fix

            self._wandb = wandb.init(project=wandb_project, config=config, dir=str(self.dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, "time": time.time(), **{k: float(v) for k, v in metrics.items()}}
        if self._last is not None and self._last[0] == step:
            offset = self._last[1]
            record = {**self._last[2], **record}
            self._jsonl.truncate(offset)  # appends go to the new end
        else:
            offset = self._jsonl.seek(0, os.SEEK_END)
        self._jsonl.write((json.dumps(record) + "\n").encode())
        self._last = (step, offset, record)
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(key, float(value), step)
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def keep_rows_up_to(path: Path, step: int) -> tuple[int, int, dict[str, Any]] | None:
    """Rewrite ``path`` (atomically) with its rows of steps <= ``step``, one row per step (rows of
    one step merged; a torn last line dropped). Returns (step, byte offset, row) of the last row."""
    if not path.is_file():
        return None
    rows: dict[int, dict[str, Any]] = {}
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
            rows[row["step"]] = {**rows.get(row["step"], {}), **row}
    lines = [(json.dumps(rows[k]) + "\n").encode() for k in sorted(rows)]
    tmp = path.with_suffix(".tmp")
    with tmp.open("wb") as f:
        f.write(b"".join(lines))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    if not rows:
        return None
    last = max(rows)
    return last, sum(len(line) for line in lines[:-1]), rows[last]
