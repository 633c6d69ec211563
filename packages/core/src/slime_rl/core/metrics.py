"""Per-step metrics to JSONL, TensorBoard (when installed) and wandb (when configured)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


class MetricsLogger:
    def __init__(self, log_dir: str | Path, *, tensorboard: bool = True, wandb_project: str | None = None,
                 config: dict[str, Any] | None = None):
        self.dir = Path(log_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.dir / "metrics.jsonl"
        self._jsonl = self.jsonl_path.open("a", buffering=1)
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
        self._jsonl.write(json.dumps(record) + "\n")
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
