"""Print an on-policy distillation run's curve from its metrics.jsonl (issue 39): per step the student's reverse
KL to the teacher (opd/reverse_kl, k1 on its own sampled tokens), the step's time split (teacher prefill, rollout,
train), the task reward, and the held-out evals; last, the KL's fall from its first 3 steps to its last 3.

    python benchmarks/opd_curve.py RUN/metrics.jsonl [--teacher-eval 0.69]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summary(rows: list[dict]) -> dict[str, float]:
    kls = [r["opd/reverse_kl"] for r in rows if "opd/reverse_kl" in r]
    evals = [v for r in rows for k, v in r.items() if k.startswith("eval/") and k.endswith("pass@1")]
    first, last = statistics.fmean(kls[:3]), statistics.fmean(kls[-3:])
    return {"steps": len(kls), "kl_first3": first, "kl_last3": last, "kl_fall": 1 - last / first if first else 0.0,
            "eval_first": evals[0] if evals else float("nan"), "eval_last": evals[-1] if evals else float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics", type=Path)
    parser.add_argument("--teacher-eval", type=float, default=None, help="the teacher's held-out pass@1")
    args = parser.parse_args()
    rows = rows_of(args.metrics)
    print(f"{'step':>4} {'reverse_kl':>10} {'teacher_s':>9} {'rollout_s':>9} {'train_s':>8} {'step_s':>7}"
          f" {'reward':>6}  eval")
    for r in rows:
        evals = " ".join(f"{k.removeprefix('eval/')}={v:.3f}" for k, v in r.items()
                         if k.startswith("eval/") and k.endswith("pass@1"))
        if "opd/reverse_kl" not in r:
            print(f"{r['step']:>4} {'':>10} {'':>9} {'':>9} {'':>8} {'':>7} {'':>6}  {evals}")
            continue
        print(f"{r['step']:>4} {r['opd/reverse_kl']:>10.4f} {r.get('time/teacher_prefill', 0):>9.2f}"
              f" {r.get('time/rollout', 0):>9.2f} {r.get('time/train', 0):>8.2f} {r.get('time/step', 0):>7.2f}"
              f" {r.get('rollout/reward_mean', 0):>6.3f}  {evals}")
    s = summary(rows)
    line = (f"reverse KL {s['kl_first3']:.4f} (first 3 steps) -> {s['kl_last3']:.4f} (last 3): fell"
            f" {100 * s['kl_fall']:.0f}%; held-out pass@1 {s['eval_first']:.3f} -> {s['eval_last']:.3f}")
    if args.teacher_eval is not None:
        line += f" (teacher {args.teacher_eval:.3f}, gap {args.teacher_eval - s['eval_last']:+.3f})"
    print(line)


if __name__ == "__main__":
    main()
