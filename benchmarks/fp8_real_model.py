"""Issue 38's real-model comparison: SmolLM2-135M-Instruct on addition in three variants side by side on one GPU.

    python benchmarks/fp8_real_model.py run --logs LOGDIR          # the GPU stage fp8-real-model (one device call)
    python benchmarks/fp8_real_model.py compare LOGDIR/fp8-real-model --png docs/fp8-real-model-gap.png
    python benchmarks/fp8_real_model.py overrides fp8-tis          # one variant's slime-cli overrides

The variants (`VARIANTS`) are the real-model run (examples/smollm2_gpu_addition.yaml: SGLang and Megatron
colocated, 30 GRPO steps of 16 x 8) with the engine serving bf16 weights, FP8 weights corrected by token-level TIS,
and FP8 weights corrected by sequence-level masked IS (`seq-mask-tis`); all three on the addition pairs with 256
held out (scripts/gpu/make_smollm2_data.py writes addition256_*), evaluated greedily before, every 10 steps and after.

`run` starts the three `slime-cli train` processes on the one GPU, ``--stagger`` seconds apart (each run starts its
own Ray and picks its own free ports; spaced out, two never race for one), each SGLang engine with
``mem_fraction_static`` `MEM_FRACTION`: SGLang 0.5.17 sizes its KV pool from the memory free when it starts
(``budget = free now - free before loading x (1 - fraction)``, kv_pool_runtime.py) and caps it at the config's
``max_total_tokens`` (65,536 tokens, ~1.5 GB for this model), so a fraction this large leaves room for the other
runs' allocations while it starts. Each run is interrupted (SIGINT: slime-cli shuts down cleanly) at the
``--deadline``. The runs write into ``--work`` (their folders hold SGLang's FP8 copies and restore copies, hundreds
of MB); what is kept is copied to LOGDIR/fp8-real-model (`keep`): each run's metrics.jsonl and one archive of the
runs' console logs, since a device call returns at most 8 files from $OUT. Then `compare` runs on that folder.

`compare` prints, per variant, held-out pass@1 at every eval, the mean over the step-20 and step-30 evals and its
difference from the bf16 run's (issue 38: within 0.1), the train/rollout log-prob gap per step (mean, and its
trend, from benchmarks/plot_logprob_gap.py) and the share of tokens and sequences the correction masked; with
``--png`` the gap per step of all three in one plot. Exits 1 when a run is missing, an FP8 run's mean is not within
``--tolerance`` of bf16's, or the bf16 run did not learn (its step-30 eval not above its step-0 eval).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from plot_logprob_gap import RunGap, fit_trend, plot, read_run  # sibling script

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "smollm2_gpu_addition.yaml"
DATA = ROOT / ".gpu" / "smol-data"
TASK = "addition256"  # the data files' prefix
EVAL = "addition"  # the eval set's name: the config's own, so the override replaces its 64 prompts with these 256
EVAL_STEPS = (20, 30)
MIN_EVAL_PROMPTS = 256  # issue 38: each run evaluated on >= 256 held-out prompts
MEM_FRACTION = 0.4
VARIANTS = {
    "bf16": [],
    "fp8-tis": ["rollout.precision=fp8", "algorithm.rollout_correction=tis"],
    "fp8-seq-mis": ["rollout.precision=fp8", "algorithm.rollout_correction=seq-mask-tis"],
}
MASKED_KEYS = ("train/rollout_corr_masked_frac", "train/rollout_corr_masked_seq_frac")


def overrides(variant: str, run_dir: Path, data: Path = DATA) -> list[str]:
    """The `slime-cli train` overrides of ``variant`` on top of examples/smollm2_gpu_addition.yaml."""
    return [f"logging.dir={run_dir}", f"data.prompt_data={data / f'{TASK}_train.jsonl'}",
            f"eval.prompt_data.{EVAL}={data / f'{TASK}_eval.jsonl'}",
            f"rollout.sglang.server_args.mem_fraction_static={MEM_FRACTION}", *VARIANTS[variant]]


# ------------------------------------------------------------------ run: three runs side by side


def run_all(logs: Path, *, data: Path, stagger_s: float, deadline_s: float, python: str = sys.executable) -> int:
    """Start every variant's run, ``stagger_s`` apart; interrupt what is still running at ``deadline_s``."""
    missing = [p for p in (data / f"{TASK}_train.jsonl", data / f"{TASK}_eval.jsonl") if not p.is_file()]
    if missing:
        print(f"error: {', '.join(map(str, missing))} missing: `python scripts/gpu/make_smollm2_data.py` writes "
              "them (scripts/gpu/pack_smollm2.sh runs it) and the call carries .gpu/smol-data", file=sys.stderr)
        return 2
    began = time.monotonic()
    procs: dict[str, subprocess.Popen] = {}
    for k, variant in enumerate(VARIANTS):
        if k:
            time.sleep(stagger_s)
        run_dir = logs / variant
        # what an earlier call on this machine left of this run (it would be resumed); nothing else in ``logs``
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(logs / f"{variant}.log", "wb") as log:
            # its own session: the interrupt at the deadline reaches slime-cli, not this process
            procs[variant] = subprocess.Popen([python, "-m", "slime_rl.cli.app", "train", str(CONFIG),
                                               *overrides(variant, run_dir, data)], stdout=log,
                                              stderr=subprocess.STDOUT, start_new_session=True)
        print(f"[fp8-real-model] {variant}: started at {time.monotonic() - began:.0f} s", flush=True)
    codes = {variant: wait(proc, began + deadline_s) for variant, proc in procs.items()}
    for variant, code in codes.items():
        print(f"[fp8-real-model] {variant}: exit {code} ({logs / f'{variant}.log'})")
        if code:
            tail = (logs / f"{variant}.log").read_text(errors="replace").splitlines()[-15:]
            print("\n".join(f"[fp8-real-model]   {line}" for line in tail))
    print(f"[fp8-real-model] all done in {time.monotonic() - began:.0f} s", flush=True)
    return 1 if any(codes.values()) else 0


def keep(work: Path, out: Path) -> list[Path]:
    """Each run's metrics.jsonl (as ``out/<variant>/metrics.jsonl``, what `compare` reads) and one archive of the
    runs' console logs (``out/logs.tgz``): what a device call brings back of the runs."""
    kept = []
    for variant in VARIANTS:
        metrics = work / variant / "metrics.jsonl"
        if metrics.is_file():
            (out / variant).mkdir(parents=True, exist_ok=True)
            kept.append(Path(shutil.copy2(metrics, out / variant / "metrics.jsonl")))
    logs = sorted(work.glob("*.log"))
    if logs:
        out.mkdir(parents=True, exist_ok=True)
        with tarfile.open(out / "logs.tgz", "w:gz") as archive:
            for log in logs:
                archive.add(log, arcname=log.name)
        kept.append(out / "logs.tgz")
    return kept


def wait(proc: subprocess.Popen, deadline: float, grace_s: float = 30.0) -> int:
    """The exit code, after SIGINT at ``deadline`` and SIGKILL of its group ``grace_s`` later if need be."""
    try:
        return proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


# ------------------------------------------------------------------ compare: what they learned


@dataclass
class VariantResult:
    run: RunGap  # the gap per step and the evals (plot_logprob_gap.read_run)
    masked: dict[str, float] = field(default_factory=dict)  # mean over steps of each MASKED_KEYS present
    eval_prompts: int = 0  # held-out prompts each eval scored

    @property
    def evals(self) -> list[tuple[int, float]]:
        """(step, held-out pass@1) of the eval set."""
        return self.run.evals.get(EVAL, [])

    @property
    def gaps(self) -> list[float]:
        return self.run.gaps

    @property
    def gap_slope(self) -> float:
        return fit_trend(self.run.steps, self.run.gaps).slope

    def eval_at(self, step: int) -> float | None:
        values = [v for s, v in self.evals if s == step]
        return values[-1] if values else None

    @property
    def late_mean(self) -> float | None:
        """Mean held-out pass@1 over the step-20 and step-30 evals (None if either is missing)."""
        values = [self.eval_at(s) for s in EVAL_STEPS]
        return None if None in values else sum(values) / len(values)


def read_variant(metrics: Path, variant: str) -> VariantResult:
    run = read_run(metrics, variant)
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    masked = {}
    for key in MASKED_KEYS:
        values = [float(r[key]) for r in rows if key in r]
        if values:
            masked[key] = sum(values) / len(values)
    prompts = [int(r[f"eval/{EVAL}/prompts"]) for r in rows if f"eval/{EVAL}/prompts" in r]
    return VariantResult(run, masked, min(prompts, default=0))


def compare(folder: Path, *, tolerance: float, png: Path | None) -> int:
    results, problems = {}, []
    for variant in VARIANTS:
        metrics = folder / variant / "metrics.jsonl"
        if not metrics.is_file():
            problems.append(f"{variant}: {metrics} is missing (its console log: {variant}.log in"
                            f" {folder / 'logs.tgz'})")
            continue
        try:
            results[variant] = read_variant(metrics, variant)
        except (OSError, ValueError) as err:
            problems.append(f"{variant}: {err}")
    steps = sorted({s for r in results.values() for s, _ in r.evals})
    print("| variant | eval prompts | " + " | ".join(f"pass@1 step {s}" for s in steps)
          + " | mean of steps 20, 30 | vs bf16 | gap mean | gap slope / step | masked tokens | masked seqs |")
    print("|---|" + "---:|" * (len(steps) + 7))
    base = results.get("bf16")
    for variant, r in results.items():
        late = r.late_mean
        diff = late - base.late_mean if late is not None and base and base.late_mean is not None else None
        cells = [str(r.eval_prompts)] + [f"{r.eval_at(s):.3f}" if r.eval_at(s) is not None else "-" for s in steps]
        cells += [f"{late:.3f}" if late is not None else "-", f"{diff:+.3f}" if diff is not None else "-",
                  f"{sum(r.gaps) / len(r.gaps):.4f}", f"{r.gap_slope:+.2e}"]
        cells += [f"{100 * r.masked[k]:.2f}%" if k in r.masked else "-" for k in MASKED_KEYS]
        print(f"| {variant} | " + " | ".join(cells) + " |")
        if r.evals and r.eval_prompts < MIN_EVAL_PROMPTS:
            problems.append(f"{variant}: its evals scored {r.eval_prompts} held-out prompts, fewer than "
                            f"{MIN_EVAL_PROMPTS}")
    if base is None or base.late_mean is None:
        problems.append("bf16: no held-out evals at steps 20 and 30 to compare with")
    else:
        first, last = base.eval_at(0), base.eval_at(30)
        if first is None or last is None or last <= first:
            problems.append(f"bf16: did not learn (held-out pass@1 step 0 {first}, step 30 {last})")
        for variant, r in results.items():
            if variant == "bf16":
                continue
            if r.late_mean is None:
                problems.append(f"{variant}: no held-out evals at steps 20 and 30")
                continue
            diff = r.late_mean - base.late_mean
            verdict = "PASS" if abs(diff) <= tolerance else "FAIL"
            print(f"[fp8-real-model] {verdict} {variant}: mean held-out pass@1 at steps 20 and 30 "
                  f"{r.late_mean:.3f} against bf16's {base.late_mean:.3f} ({diff:+.3f}, bound +-{tolerance})")
            if verdict == "FAIL":
                problems.append(f"{variant}: {diff:+.3f} from bf16, beyond +-{tolerance}")
    if png and results:
        plot([r.run for r in results.values()], png)
        print(f"wrote {png}")
    for problem in problems:
        print(f"[fp8-real-model] FAIL {problem}")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="the three runs side by side, then compare")
    run.add_argument("--logs", type=Path, required=True, help="what is kept goes to LOGS/fp8-real-model")
    run.add_argument("--work", type=Path, default=Path("/tmp/fp8-real-model"), help="the runs' own folders")
    run.add_argument("--data", type=Path, default=DATA)
    run.add_argument("--stagger", type=float, default=20.0, help="seconds between the runs' starts")
    run.add_argument("--deadline", type=float, default=540.0, help="seconds from the first start to interrupt")
    cmp = sub.add_parser("compare", help="the table and verdicts of finished runs")
    cmp.add_argument("folder", type=Path, help="the folder holding <variant>/metrics.jsonl")
    for p in (run, cmp):
        p.add_argument("--tolerance", type=float, default=0.1)
        p.add_argument("--png", type=Path, help="plot the gap per step of all three here (needs matplotlib)")
    one = sub.add_parser("overrides", help="print one variant's slime-cli overrides")
    one.add_argument("variant", choices=sorted(VARIANTS))
    one.add_argument("--run-dir", type=Path, default=Path("runs/fp8-real-model"))
    args = parser.parse_args(argv)
    if args.command == "overrides":
        print("\n".join(overrides(args.variant, args.run_dir / args.variant)))
        return 0
    if args.command == "compare":
        return compare(args.folder, tolerance=args.tolerance, png=args.png)
    code = run_all(args.work, data=args.data, stagger_s=args.stagger, deadline_s=args.deadline)
    if code == 2:
        return code
    folder = args.logs / "fp8-real-model"
    keep(args.work, folder)
    return max(code, compare(folder, tolerance=args.tolerance, png=args.png))


if __name__ == "__main__":
    sys.exit(main())
