"""What `slime-cli train` shows: live progress fed by the loop's callback, then a summary table.

On a terminal, a rich progress bar (step k/N, reward mean and its moving average, the last
eval, seconds per step); otherwise, or with ``logging.progress_bar=false``, one plain line per
step and per eval, which reads well in a log file. The loop in core knows nothing of this: it
only calls ``callback(event, payload)``.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from slime_rl.core.config import Config
from slime_rl.core.run import checkpoint

Callback = Callable[[str, dict[str, Any]], None]
REWARD_KEY = "rollout/reward_mean"
WINDOW = 10  # steps in the reward's (and the step time's) moving average


@dataclass
class RunState:
    """What the loop's events said so far, and when (perf_counter seconds)."""

    began: float = field(default_factory=time.perf_counter)  # when the CLI handed the config to the loop
    num_steps: int | None = None
    start_step: int = 0
    step: int = 0
    started: float | None = None  # the "start" event: Ray, trainer and engines are up
    done: float | None = None
    rewards: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    last_eval: tuple[int, dict[str, float]] | None = None

    def update(self, event: str, payload: dict[str, Any]) -> None:
        now = time.perf_counter()
        if event == "start":
            self.started = now
            self.num_steps = payload.get("num_steps")
            self.start_step = self.step = payload.get("start_step", 0)
        elif event == "eval":
            self.last_eval = (payload["step"], payload["metrics"])
        elif event == "step":
            self.step = payload["step"]
            metrics = payload["metrics"]
            if REWARD_KEY in metrics:
                self.rewards.append(metrics[REWARD_KEY])
            if "time/step" in metrics:
                self.step_times.append(metrics["time/step"])
        elif event == "done":
            self.done = now

    def reward_avg(self) -> float | None:
        recent = self.rewards[-WINDOW:]
        return statistics.fmean(recent) if recent else None

    def step_s(self) -> float | None:
        recent = self.step_times[-WINDOW:]
        return statistics.fmean(recent) if recent else None

    def status(self) -> str:
        """The reward, the last eval's headline and the step time, in one short line."""
        parts = []
        if self.rewards:
            parts.append(f"reward {self.rewards[-1]:.3f} (avg{WINDOW} {self.reward_avg():.3f})")
        if self.last_eval is not None:
            key = headline_eval_key(self.last_eval[1])
            if key is not None:
                parts.append(f"{short(key)} {self.last_eval[1][key]:.3f} @{self.last_eval[0]}")
        if self.step_times:
            parts.append(f"{self.step_s():.2f} s/step")
        return "  ".join(parts)


def headline_eval_key(metrics: dict[str, float]) -> str | None:
    """The first eval set's pass@k (for the demo: held-out greedy accuracy), else its first metric."""
    keys = sorted(metrics)
    return next((k for k in keys if "/pass@" in k), keys[0] if keys else None)


def short(key: str) -> str:
    return key.removeprefix("eval/")


def _of_total(state: RunState) -> str:
    return f"{state.step}/{state.num_steps}" if state.num_steps is not None else str(state.step)


def _line(event: str, payload: dict[str, Any], state: RunState) -> str | None:
    """The plain log line for an event, or None."""
    if event == "start":
        resumed = f", resumed from step {state.start_step}" if state.start_step else ""
        total = state.num_steps if state.num_steps is not None else "until the data runs out"
        return f"started in {state.started - state.began:.1f} s: {total} steps{resumed}"
    if event == "eval":
        values = "  ".join(f"{short(k)} {v:.3f}" for k, v in sorted(payload["metrics"].items()))
        return f"eval @ step {payload['step']}: {values}"
    if event == "step":
        if payload.get("failure"):
            return f"step {_of_total(state)}  failed, not trained on: {payload['failure']}"
        return f"step {_of_total(state)}  {state.status()}"
    return None


@contextlib.contextmanager
def show_progress(console: Console, *, bar: bool) -> Iterator[tuple[Callback, RunState]]:
    """Yields (callback for the loop, the state it fills). ``bar``: a live rich bar; else plain lines."""
    state = RunState()
    if not bar:
        def print_lines(event: str, payload: dict[str, Any]) -> None:
            state.update(event, payload)
            line = _line(event, payload, state)
            if line is not None:
                console.print(line, markup=False, highlight=False, soft_wrap=True)

        yield print_lines, state
        return

    # Narrow columns: the status (reward, eval, s/step) is what a user watches.
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(bar_width=20),
                        TextColumn("{task.fields[status]}"), TextColumn("eta"), TimeRemainingColumn(),
                        console=console)
    with progress:
        task = progress.add_task("starting Ray, trainer and engines", total=None, status="")  # bar pulses

        def update_bar(event: str, payload: dict[str, Any]) -> None:
            state.update(event, payload)
            if event == "start":  # a fresh task from here: the eta counts only this run's steps
                progress.reset(task, total=state.num_steps, completed=state.start_step)
            if event == "eval" and state.started is not None and payload["step"] == state.start_step:
                progress.reset(task, total=state.num_steps, completed=state.start_step)  # the first eval is no step
            progress.update(task, completed=state.step, description=f"step {_of_total(state)}",
                            status=state.status() or ("evaluating" if event == "start" else ""))
            if event == "step" and payload.get("failure"):  # why, above the bar, as it happens
                progress.console.print(_line(event, payload, state), markup=False, highlight=False, soft_wrap=True)

        yield update_bar, state


def _seconds(value: float | None) -> str:
    return "?" if value is None else f"{value:.1f} s"


def summary_table(summary: dict[str, Any], cfg: Config, state: RunState, total_s: float) -> Table:
    """Eval before and after, steps, wall time, and where the metrics and checkpoint are."""
    table = Table(title="slime-cli train: done", show_header=False, title_justify="left")
    table.add_column("what", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")

    before, after = summary.get("eval_before") or {}, summary.get("eval_after") or {}
    start = summary.get("start_step", state.start_step)
    steps = summary.get("steps", state.step)
    greedy = cfg.eval.temperature == 0 and cfg.eval.n_samples_per_prompt == 1
    for key in sorted(set(before) | set(after)):
        label = short(key) + (" (greedy accuracy)" if greedy and key.endswith("/pass@1") else "")
        was = f"{before[key]:.3f}" if key in before else "-"
        now = f"{after[key]:.3f}" if key in after else "-"
        table.add_row(label, f"{was} -> {now}  (step {start} -> {steps})")

    resumed = f", resumed from step {start}" if start else ""
    table.add_row("steps", f"{steps - start} run (now at step {steps}{resumed})")

    startup = state.started - state.began if state.started is not None else None
    training = ((state.done or state.began + total_s) - state.started) if state.started is not None else None
    per_step = f", median {statistics.median(state.step_times):.2f} s/step" if state.step_times else ""
    table.add_row("wall time", f"{_seconds(total_s)} total: startup {_seconds(startup)}, "
                               f"training {_seconds(training)}{per_step}")

    log_dir = Path(summary.get("log_dir", cfg.logging.dir))
    table.add_row("metrics (JSONL)", str(summary.get("metrics_file", log_dir / "metrics.jsonl")))
    tensorboard = log_dir / "tensorboard"
    if tensorboard.is_dir():
        table.add_row("TensorBoard", f"tensorboard --logdir {tensorboard}")
    else:
        table.add_row("TensorBoard", "not written: pip install tensorboard" if cfg.logging.tensorboard
                      else "off (logging.tensorboard=false)")
    if cfg.logging.wandb_project:
        table.add_row("wandb", f"project {cfg.logging.wandb_project}")

    save_dir = Path(summary.get("checkpoint_dir", cfg.checkpoint_dir))
    saved = checkpoint.latest(save_dir)
    if saved is not None:
        table.add_row("checkpoint", f"{saved[0]} (step {saved[1]['step']}; --resume continues from it)")
    else:
        table.add_row("checkpoint", f"none saved in {save_dir}")
    return table
