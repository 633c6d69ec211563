"""One colocated GRPO step through the real loop, phase by phase: where a step's time and memory go.

    python benchmarks/colocated_step.py                                   # the H200 run: 3B shape, SGLang, offload
    python benchmarks/colocated_step.py --cuda-graphs off                 # the same with SGLang's CUDA graphs off
    python benchmarks/colocated_step.py --device cpu --engine hf --shape tiny --prompts 2 --samples 2 \\
        --prompt-len 8 --response-len 4 --steps 1                         # the CPU smoke test

`slime_rl.core.run.loop.train` runs ``--steps`` steps (Megatron trainer, ``--engine`` rollout, colocated on one
device, ``cluster.offload`` on unless ``--no-offload``) on a random model of ``--shape`` (made on the spot)
and random ``--prompt-len``-token prompts, with the config's defaults otherwise (micro-batching by
`trainer.max_tokens_per_gpu`). The loop's phases are timed by the loop itself (`metrics.phase`, which this
script wraps to learn when each phase ran); on CUDA a ``nvidia-smi`` sampler gives the device's memory in
use and its busy fraction over each phase, and ``psutil`` the host's memory. MFU of the train phase is
6 x parameters x trained tokens (prompt + response) / (train seconds x ``--peak-tflops``), recompute not
counted. ``--timeout`` stops a stalled run and prints the driver's stacks and the engine logs' tails.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from weight_sync import SHAPES, make_model_folder, param_count_of  # noqa: E402  (a sibling script)

GPU_ENGINE_ARGS = {"attention_backend": "triton", "sampling_backend": "pytorch", "grammar_backend": "none"}
NO_CUDA_GRAPHS = {"cuda_graph_backend_decode": "disabled", "cuda_graph_backend_prefill": "disabled"}


@dataclass
class Sampler:
    """Device memory in use and busy % (``nvidia-smi``, every 100 ms) and host memory in use (psutil)."""

    on_cuda: bool
    gpu: list[tuple[float, float, float]] = field(default_factory=list)  # (time, busy %, MiB used)
    host: list[tuple[float, float]] = field(default_factory=list)  # (time, GiB used)

    def __enter__(self) -> Sampler:
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._host_loop, daemon=True)]
        if self.on_cuda:
            self._smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,utilization.gpu,memory.used",
                                          "--format=csv,noheader,nounits", "-lms", "100", "-i", "0"],
                                         stdout=subprocess.PIPE, text=True)
            self._threads.append(threading.Thread(target=self._gpu_loop, daemon=True))
        for thread in self._threads:
            thread.start()
        return self

    def _gpu_loop(self) -> None:
        for line in self._smi.stdout:  # the timestamp field: lines may arrive late when piped
            try:
                stamp, busy, used = (part.strip() for part in line.split(","))
                when = datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").timestamp()
                self.gpu.append((when, float(busy), float(used)))
            except ValueError:
                continue

    def _host_loop(self) -> None:
        import psutil

        while not self._stop.wait(0.2):
            self.host.append((time.time(), psutil.virtual_memory().used / 2**30))

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.on_cuda:
            time.sleep(0.3)
            self._smi.terminate()
        for thread in self._threads:
            thread.join(timeout=5)

    def over(self, start: float, end: float) -> tuple[float | None, float | None, float | None]:
        """(peak device GiB, mean busy fraction, peak host GiB) over [start, end]; None without samples."""
        gpu = [(busy, used) for t, busy, used in self.gpu if start <= t <= end]
        host = [used for t, used in self.host if start <= t <= end]
        return (max(u for _, u in gpu) / 1024 if gpu else None, sum(b for b, _ in gpu) / len(gpu) / 100 if gpu else None,
                max(host) if host else None)


@contextlib.contextmanager
def recorded_phases(windows: list[tuple[str, float, float]]):
    """Wrap the loop's `phase` so each phase's wall-clock window is kept too."""
    import slime_rl.core.run.loop as loop

    original = loop.phase

    @contextlib.contextmanager
    def phase(timings: dict[str, float], name: str):
        start = time.time()
        try:
            with original(timings, name):
                yield
        finally:
            windows.append((name, start, time.time()))

    loop.phase = phase
    try:
        yield
    finally:
        loop.phase = original


def write_prompts(path: Path, folder: Path, count: int, prompt_len: int, seed: int = 0) -> Path:
    """``count`` prompts of about ``prompt_len`` tokens of the folder's tokenizer (random ids, decoded)."""
    import random

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    rng = random.Random(seed)
    with path.open("w") as out:
        for _ in range(count):
            ids = [rng.randrange(1, len(tokenizer)) for _ in range(prompt_len)]
            text = tokenizer.decode(ids)
            ids = tokenizer(text)["input_ids"][:prompt_len]  # decoding and encoding again may merge tokens
            out.write(json.dumps({"input": tokenizer.decode(ids), "label": ""}) + "\n")
    return path


def run_config(args, folder: Path, prompts: Path, run_dir: Path) -> dict:
    on_cuda = args.device == "cuda"
    engine_args = dict(GPU_ENGINE_ARGS, mem_fraction_static=args.mem_fraction) if on_cuda else {}
    if on_cuda and args.cuda_graphs == "off":
        engine_args.update(NO_CUDA_GRAPHS)
    rollout = {"engine": args.engine, "max_response_len": args.response_len, "temperature": 1.0,
               "reward": "exact_match"}
    if args.engine == "sglang":  # rollout.sglang: the server flags, the interpreter
        rollout["sglang"] = {"server_args": engine_args, **({"engine_python": args.engine_python} if args.engine_python
                                                            else {})}
    return {
        "model": {"path": str(folder), "dtype": "bfloat16" if on_cuda else "float32"},
        "data": {"prompt_data": str(prompts), "rollout_batch_size": args.prompts, "n_samples_per_prompt": args.samples,
                 "num_rollout": args.steps},
        "rollout": rollout,
        "trainer": {"backend": "megatron", "lr": 1e-6},
        "cluster": {"device": args.device, "colocate": True, "actor_num_gpus_per_node": 1, "offload": args.offload},
        "logging": {"dir": str(run_dir), "tensorboard": False, "progress_bar": False},
    }


def print_log_tails(run_dir: Path, lines: int = 40) -> None:
    """The last ``lines`` of every log under the run (the engines' servers and router among them)."""
    for log in sorted(run_dir.glob("**/*.log")):
        print(f"--- tail of {log}", flush=True)
        print("\n".join(log.read_text(errors="replace").splitlines()[-lines:]), flush=True)


def watchdog(seconds: float, run_dir: Path) -> threading.Timer:
    """After ``seconds``: the driver's stacks and the tails of the engine logs, then exit 3."""

    def fire() -> None:
        print(f"\n[colocated_step] TIMEOUT after {seconds:.0f} s; driver stacks:", flush=True)
        faulthandler.dump_traceback(all_threads=True)
        print_log_tails(run_dir)
        os._exit(3)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


def phase_table(rows: list[dict], windows: list[tuple[str, float, float]], sampler: Sampler) -> list[str]:
    """One table per step: each phase's seconds, share of the step, peak device memory, GPU busy."""
    starts = [i for i, (name, _, _) in enumerate(windows) if name == "rollout"] + [len(windows)]
    lines = []
    for step, row in enumerate(rows):
        steps_windows = windows[starts[step]:starts[step + 1]] if step + 1 < len(starts) else []
        total = row["time/step"]
        lines += [f"step {row['step']} ({total:.2f} s)", "",
                  "| phase | seconds | share of step | peak GPU memory GiB | GPU busy | peak host GiB |",
                  "|---|---|---|---|---|---|"]
        for name, start, end in steps_windows:
            peak, busy, host = sampler.over(start, end)
            lines.append(f"| {name} | {end - start:.2f} | {100 * (end - start) / total:.1f}% | {_fmt(peak)} | "
                         f"{_fmt(busy, pct=True)} | {_fmt(host)} |")
        if steps_windows:
            peak, busy, host = sampler.over(steps_windows[0][1], steps_windows[-1][2])
            lines.append(f"| step | {total:.2f} | 100% | {_fmt(peak)} | {_fmt(busy, pct=True)} | {_fmt(host)} |")
        lines.append("")
    return lines


def _fmt(value: float | None, pct: bool = False) -> str:
    if value is None:
        return "-"
    return f"{100 * value:.0f}%" if pct else f"{value:.1f}"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-3b", choices=sorted(SHAPES))
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--response-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--engine", default="sglang", choices=["sglang", "hf"])
    parser.add_argument("--engine-python", default=None, help="interpreter that runs sglang.launch_server")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--cuda-graphs", default="on", choices=["on", "off"], help="SGLang's CUDA graphs")
    parser.add_argument("--no-offload", dest="offload", action="store_false")
    parser.add_argument("--mem-fraction", type=float, default=0.5, help="SGLang --mem-fraction-static")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H100/H200 SXM: 989)")
    parser.add_argument("--timeout", type=float, default=0, help="seconds; 0: none")
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    from slime_rl.core.config import Config
    from slime_rl.core.run.loop import train

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="colocated-step-"))
    started = time.time()
    folder = make_model_folder(args.shape, work / "model", weights=True)
    prompts = write_prompts(work / "prompts.jsonl", folder, args.prompts * args.steps, args.prompt_len)
    params = param_count_of(folder)
    print(f"[colocated_step] {args.shape}: {params / 1e9:.2f}B parameters; model and prompts in "
          f"{time.time() - started:.1f} s", flush=True)
    run_dir = work / "run"
    timer = watchdog(args.timeout, run_dir) if args.timeout else None
    windows: list[tuple[str, float, float]] = []
    with Sampler(args.device == "cuda") as sampler, recorded_phases(windows):
        try:
            summary = train(Config.model_validate(run_config(args, folder, prompts, run_dir)))
        except Exception:
            print_log_tails(run_dir, lines=80)  # a failed engine's own account of why
            raise
    if timer is not None:
        timer.cancel()
    rows = [json.loads(line) for line in Path(summary["metrics_file"]).read_text().splitlines()]
    lines = phase_table(rows, windows, sampler)
    for row in rows:
        tokens = row["perf/tokens_per_s"] * row["time/step"]  # the batch's prompt + response tokens
        mfu = 6 * params * tokens / (row["time/train"] * args.peak_tflops * 1e12)
        moves = sum(row.get(f"time/{p}", 0.0) for p in ("offload_rollout", "onload_train", "onload_rollout_weights",
                                                         "onload_rollout", "offload_train"))
        lines.append(f"step {row['step']}: {tokens:.0f} tokens trained in {row['time/train']:.2f} s: MFU "
                     f"{100 * mfu:.1f}%; offload + onload {moves:.2f} s = {100 * moves / row['time/step']:.1f}% "
                     f"of the step")
    print("\n".join(lines), flush=True)
    result = {"rows": rows, "params": params, "windows": windows, "args": {k: str(v) for k, v in vars(args).items()}}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
