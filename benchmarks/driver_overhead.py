"""What the Ray driver itself spends on a training step, as the batch grows to millions of tokens.

Runs the real loop (slime_rl.core.run.loop.train, Ray, the rollout worker, the trainer ranks) with a
stand-in engine that answers every request at once with ``--response-len`` tokens and a stand-in
trainer that does no math (log-probs of zero, no model; its data-parallel sums are real gloo
all-reduces). What remains is the data path: samples -> columnar batch -> object store ->
trainer shards, advantages on the trainer ranks, metrics back. Per step it prints

- driver CPU s: this process's CPU time (all its threads) during the step; waiting on actors
  costs none, so this is what the driver does, not how long the step takes;
- object-store MB: the serialized size of what the step put into the object store (the shards);
- tensor MB: the bytes of the batch's tensors, for comparison (target: object store <= 1.2x);
- per-rank MB: the shard tensor bytes each data-parallel rank received (target: ~1/dp each).

    .venv/bin/python benchmarks/driver_overhead.py [--dp 1] [--steps 3] [--sizes 0.07M,0.5M,2M,8M]

Target on the 2-core CPU machine: <= 0.2 s of driver CPU time at 2M tokens, growing linearly.
Before Loop v2 the driver spent 0.08 / 0.65 / 2.56 s at 0.07M / 0.5M / 2.1M tokens (issue 15).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

# (label, prompts per step, samples per prompt, response tokens per sample)
SIZES = {"0.07M": (8, 8, 1024), "0.5M": (32, 8, 2048), "2M": (64, 8, 4096), "8M": (128, 8, 8192)}
DRIVER_TARGET_S = 0.2
STANDINS = "slime_rl.core.testing.standins"


def one_reward(sample) -> float:
    """Half the samples right (a group's rewards differ, so its advantages are not all zero)."""
    return float(sample.index % 2)


def measure(label: str, dp: int, steps: int, model: str, workdir: Path) -> dict[str, Any]:
    from slime_rl.core.config import load_config
    from slime_rl.core.run.loop import train

    prompts, n, response_len = SIZES[label]
    data = workdir / f"prompts-{label}.jsonl"
    data.write_text("".join(json.dumps({"input": f"question {i}", "label": "1"}) + "\n"
                            for i in range(prompts * (steps + 1))))
    cfg = load_config(None, [
        f"model.path={model}", f"data.prompt_data={data}", f"data.rollout_batch_size={prompts}",
        f"data.n_samples_per_prompt={n}", f"data.num_rollout={steps}", 
        f"rollout.engine={STANDINS}:InstantEngine", f"rollout.max_response_len={response_len}",
        "rollout.reward=driver_overhead:one_reward", "rollout.reward_workers=0", "rollout.max_concurrency=4096",
        f"trainer.backend={STANDINS}:NoMathTrainer", "cluster.device=cpu",
        f"cluster.actor_num_gpus_per_node={dp}", f"cluster.num_gpus_per_node={dp}",
        f"logging.dir={workdir / label / 'logs'}", f"checkpoint.save_dir={workdir / label / 'ckpt'}",
        "logging.tensorboard=false", "model.dtype=float32",
    ])
    rows: list[dict[str, float]] = []
    last = [time.process_time()]

    def on_event(event: str, payload: dict[str, Any]) -> None:
        if event == "start":
            last[0] = time.process_time()
        elif event == "step":
            now = time.process_time()
            metrics = payload["metrics"]
            rows.append({"driver_cpu_s": now - last[0], "object_bytes": metrics["perf/batch_object_bytes"],
                         "tensor_bytes": metrics["perf/batch_tensor_bytes"], "step_s": metrics["time/step"],
                         **{k: v for k, v in metrics.items() if k.startswith("train/shard_bytes/")}})
            last[0] = now

    train(cfg, callback=on_event)
    tokens = prompts * n * response_len
    measured = rows[1:] or rows  # the first step pays for warm-up (imports, first puts)
    per_rank = [statistics.median(r[f"train/shard_bytes/{k}"] for r in measured) for k in range(dp)]
    return {
        "label": label, "tokens": tokens,
        "driver_cpu_s": statistics.median(r["driver_cpu_s"] for r in measured),
        "object_mb": statistics.median(r["object_bytes"] for r in measured) / 1e6,
        "tensor_mb": statistics.median(r["tensor_bytes"] for r in measured) / 1e6,
        "per_rank_mb": [b / 1e6 for b in per_rank],
        "step_s": statistics.median(r["step_s"] for r in measured),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--sizes", default=",".join(SIZES))
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct", help="its tokenizer decodes the responses")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("SLIME_RL_TORCH_THREADS", "1")
    from slime_rl.core.config.builtin_models import resolve_model_path
    from slime_rl.core.config.cpu import cpu_info

    model = str(resolve_model_path(args.model))
    print(f"CPU: {cpu_info().describe()}; dp={args.dp}, {args.steps} steps per size (median of all but the first)")
    results = []
    with tempfile.TemporaryDirectory(prefix="driver-overhead-") as tmp:
        for label in args.sizes.split(","):
            results.append(measure(label, args.dp, args.steps, model, Path(tmp)))
            r = results[-1]
            print(f"  {label}: driver {r['driver_cpu_s']:.3f} s CPU, step {r['step_s']:.1f} s", file=sys.stderr)
    print(f"{'tokens':>8} {'driver CPU s':>12} {'us/token':>9} {'object MB':>10} {'tensor MB':>10} {'ratio':>6}  "
          "per-rank MB")
    for r in results:
        ratio = r["object_mb"] / r["tensor_mb"] if r["tensor_mb"] else float("nan")
        ranks = " ".join(f"{mb:.1f}" for mb in r["per_rank_mb"])
        print(f"{r['tokens'] / 1e6:>7.2f}M {r['driver_cpu_s']:>12.3f} {r['driver_cpu_s'] / r['tokens'] * 1e6:>9.3f} "
              f"{r['object_mb']:>10.1f} {r['tensor_mb']:>10.1f} {ratio:>6.2f}  {ranks}")
    two_m = next((r for r in results if r["label"] == "2M"), None)
    if two_m is not None:
        verdict = "meets" if two_m["driver_cpu_s"] <= DRIVER_TARGET_S else "MISSES"
        print(f"driver CPU at 2M tokens: {two_m['driver_cpu_s']:.3f} s ({verdict} the {DRIVER_TARGET_S} s target)")


if __name__ == "__main__":
    main()
