"""The train/rollout log-prob gap at every step of one or more runs: a table, its trend, and a PNG.

The gap is ``train/train_rollout_logprob_abs_diff`` in a run's metrics.jsonl: the mean over response tokens of
|log p_trainer - log p_engine| for the tokens the engine sampled, the trainer's log-probs taken before the step's
update (core/losses.py). Users of other frameworks report that it grows as training goes on (vime#64,
NeMo-RL#4243); the trend printed here is the least-squares slope over steps with its 95% interval, called a rise
or a fall only when the interval excludes zero. Also printed: each eval set's pass@1 at every eval step.

    python benchmarks/plot_logprob_gap.py RUN_DIR/metrics.jsonl [MORE ...] --png docs/real-model-logprob-gap.png
    python benchmarks/plot_logprob_gap.py RUN_DIR/metrics.jsonl --no-plot     # the text only (no matplotlib)

A run is labelled with its folder's name (the real-model stage writes <logs>/real-model/<task>/metrics.jsonl).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

GAP_KEY = "train/train_rollout_logprob_abs_diff"
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         15: 2.131, 20: 2.086, 30: 2.042, 60: 2.000}  # Student t, two-sided 95%, by degrees of freedom


@dataclass
class RunGap:
    label: str
    steps: list[int]
    gaps: list[float]
    evals: dict[str, list[tuple[int, float]]]  # eval set -> (step, pass@1)


@dataclass
class Trend:
    slope: float  # gap units per step
    half_width: float  # of the 95% interval; nan with fewer than 3 steps
    intercept: float

    @property
    def verdict(self) -> str:
        if math.isnan(self.half_width):
            return "has too few steps for a trend"
        if self.slope - self.half_width > 0:
            return "rises"
        if self.slope + self.half_width < 0:
            return "falls"
        return "shows no clear trend (the 95% interval holds zero)"


def read_run(path: Path, label: str | None = None) -> RunGap:
    """The gap per training step and the pass@1 of every eval set from one metrics.jsonl."""
    steps, gaps, evals = [], [], {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not JSON ({err.msg})") from None
        if GAP_KEY in row:
            steps.append(int(row["step"]))
            gaps.append(float(row[GAP_KEY]))
        for key, value in row.items():
            if key.startswith("eval/") and key.endswith("/pass@1"):
                evals.setdefault(key.split("/")[1], []).append((int(row["step"]), float(value)))
    if not gaps:
        raise ValueError(f"{path}: no row has {GAP_KEY}: the gap is logged by trainers given the engine's "
                         "log-probs (every built-in engine returns them)")
    return RunGap(label or path.parent.name, steps, gaps, evals)


def fit_trend(steps: list[int], gaps: list[float]) -> Trend:
    """Ordinary least squares gap = intercept + slope * step, with the slope's 95% interval."""
    n = len(steps)
    mean_x, mean_y = sum(steps) / n, sum(gaps) / n
    sxx = sum((x - mean_x) ** 2 for x in steps)
    if sxx == 0:
        return Trend(0.0, math.nan, mean_y)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(steps, gaps, strict=True)) / sxx
    intercept = mean_y - slope * mean_x
    if n < 3:
        return Trend(slope, math.nan, intercept)
    residual = sum((y - intercept - slope * x) ** 2 for x, y in zip(steps, gaps, strict=True))
    dof = n - 2
    t = T_975[max(d for d in T_975 if d <= dof)]  # the nearest tabled dof below: a slightly wider interval
    return Trend(slope, t * math.sqrt(residual / dof / sxx), intercept)


def report(run: RunGap) -> list[str]:
    trend = fit_trend(run.steps, run.gaps)
    third = max(1, len(run.gaps) // 3)
    first, last = sum(run.gaps[:third]) / third, sum(run.gaps[-third:]) / third
    lines = [f"[gap] {run.label}: {len(run.gaps)} steps, |log p_train - log p_rollout| per step:",
             "[gap]   " + " ".join(f"{g:.4f}" for g in run.gaps),
             f"[gap] {run.label}: first third {first:.4f}, last third {last:.4f}; slope {trend.slope:+.2e} per step"
             + (f" (95% interval +-{trend.half_width:.2e})" if not math.isnan(trend.half_width) else "")
             + f": the gap {trend.verdict}"]
    for name, points in sorted(run.evals.items()):
        lines.append(f"[eval] {run.label}/{name} pass@1: " + ", ".join(f"step {s} {v:.3f}" for s, v in points))
    return lines


def plot(runs: list[RunGap], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for run in runs:
        trend = fit_trend(run.steps, run.gaps)
        (line,) = ax.plot(run.steps, run.gaps, marker="o", markersize=3, label=f"{run.label} ({trend.verdict})")
        ends = [run.steps[0], run.steps[-1]]
        ax.plot(ends, [trend.intercept + trend.slope * x for x in ends], linestyle="--", color=line.get_color())
    ax.set_xlabel("training step")
    ax.set_ylabel("mean |log p_trainer - log p_engine| per token")
    ax.set_title("train/rollout log-prob gap (dashed: least-squares fit)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics", type=Path, nargs="+", help="metrics.jsonl files, one per run")
    parser.add_argument("--label", nargs="+", help="one label per file (default: each file's folder name)")
    parser.add_argument("--png", type=Path, default=Path("docs/real-model-logprob-gap.png"))
    parser.add_argument("--no-plot", action="store_true", help="print only (where matplotlib is missing)")
    args = parser.parse_args(argv)
    if args.label and len(args.label) != len(args.metrics):
        parser.error(f"--label: give one label per metrics file ({len(args.metrics)}), got {len(args.label)}")
    labels = args.label or [None] * len(args.metrics)
    try:
        runs = [read_run(path, label) for path, label in zip(args.metrics, labels, strict=True)]
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for run in runs:
        print("\n".join(report(run)))
    if not args.no_plot:
        plot(runs, args.png)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
