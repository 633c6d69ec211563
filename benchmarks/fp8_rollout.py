"""FP8 rollouts (issue 38, docs/fp8.md) on one GPU: what the bundle's SGLang can run and what FP8 buys.

    python benchmarks/fp8_rollout.py gemm                            # the --fp8-gemm-backend choices, tried
    python benchmarks/fp8_rollout.py rollout --variants bf16 fp8 fp8-kv --json OUT.json
    python benchmarks/fp8_rollout.py sync --json OUT.json            # the 7B sync, bf16 vs FP8 with quantisation
    python benchmarks/fp8_rollout.py table OUT.json ...              # one table over the rows of earlier calls
    python benchmarks/fp8_rollout.py sync --shape tiny --device cpu --python STANDIN_PYTHON   # the CPU smoke test

- ``gemm``: every choice of SGLang's ``--fp8-gemm-backend`` (server_args.FP8_GEMM_RUNNER_BACKEND_CHOICES) runs
  SGLang's block-FP8 linear (``dispatch_w8a8_block_fp8_linear``), and its per-channel linear
  (``apply_fp8_linear``, what ``--quantization fp8`` serves a bf16 checkpoint with) runs too, on the Qwen2.5-7B
  projections at a decode batch
  (256 rows) and a prefill chunk (8192 rows), with weights quantised by core's fp8.py: usable or the error, its
  error against the bf16 product of the dequantised weight, and microseconds per call against bf16's, each timed
  as a CUDA graph replay (as SGLang decodes; ``graph_us``, or ``graph_error`` where capture fails) and eagerly,
  for reference (``us``: the host's launch overhead included, a flat ~155 us a call at 256 rows on an H100);
- ``rollout``: the Qwen2.5-7B shape (random weights: SGLang's ``--load-format dummy``), one server per variant
  (``bf16``; ``fp8``: block-FP8 weights from a quantization_config; ``fp8-kv``: FP8 weights and
  ``--kv-cache-dtype fp8_e4m3``; ``fp8-channel``: the bf16 folder with ``--quantization fp8``, SGLang's own
  per-channel quantisation at load and its CUTLASS scaled-mm, the path ``--load-format flash_rl`` re-quantises
  into at each sync) with the same flags, CUDA graphs on, ``--requests`` requests of
  ``--prompt-len`` random tokens + ``--max-new-tokens`` new ones (ignore_eos), ``--concurrency`` in flight,
  straight to the server (benchmarks/rollout_throughput.py's ``sglang_alone``); new tokens per second, after a
  warm-up wave. Target: fp8 >= 1.3x bf16;
- ``sync``: the training loop's sync (`SGLangEngine.begin_weight_sync`, `SGLangWeightSender.send`,
  `end_weight_sync`) of random bf16 7B weights on this GPU into a bf16 server and, quantised on the GPU at every
  sync, into an FP8 one, by CUDA IPC in 2 GiB buckets; median seconds, the engines' checksums compared after the
  last. Target: FP8 <= 1.5x bf16 and <= 0.75 s.

Each mode prints its table; ``--json`` appends its rows to a file, ``table`` prints the ratios over such files
(one device call per mode fits the 10-minute limit).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

SHAPE = "qwen2.5-7b"
# hidden 3584, q/k/v 3584/512/512, gate/up 18944 x2, down 18944 -> 3584
GEMM_SHAPES = {"qkv_proj": (4608, 3584), "o_proj": (3584, 3584), "gate_up_proj": (37888, 3584),
               "down_proj": (3584, 18944)}
# the bundle's SGLang has triton attention and pytorch sampling (../shared/gpu/README.md); CUDA graphs stay on
FLAGS = {"skip_tokenizer_init": True, "attention_backend": "triton", "sampling_backend": "pytorch",
         "grammar_backend": "none", "dtype": "bfloat16", "mem_fraction_static": 0.85}


def rows_out(path: Path | None, rows: list[dict]) -> None:
    if path is None:
        return
    old = json.loads(path.read_text()) if path.is_file() else []
    path.write_text(json.dumps(old + rows, indent=1))


# ---------------------------------------------------------------------- gemm

def gemm(args) -> list[dict]:
    from sglang.srt.layers.quantization import fp8_utils
    from sglang.srt.server_args import FP8_GEMM_RUNNER_BACKEND_CHOICES

    from slime_rl.core.weights.fp8 import FP8Format, dequantize, quantize_block

    print(f"GPU {torch.cuda.get_device_name()} (compute capability {'.'.join(map(str, torch.cuda.get_device_capability()))});"
          f" --fp8-gemm-backend choices: {', '.join(FP8_GEMM_RUNNER_BACKEND_CHOICES)}", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for choice in [*FP8_GEMM_RUNNER_BACKEND_CHOICES, CHANNEL]:
        if choice != CHANNEL:
            fp8_utils.FP8_GEMM_RUNNER_BACKEND = fp8_utils.Fp8GemmRunnerBackend(choice)
        for name, (n, k) in GEMM_SHAPES.items():
            w = (torch.randn(n, k, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
            if choice != CHANNEL:
                q, scale = quantize_block(w, 128)
                dequant = dequantize(q, scale, FP8Format("block", 128), torch.bfloat16)
            else:
                q = None  # quantised by SGLang's kernel once a layer, inside the try: it may be what fails
            for m in (256, 8192):
                x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
                row = {"mode": "gemm", "backend": choice, "layer": name, "m": m, "n": n, "k": k}
                try:
                    if choice == CHANNEL:
                        if q is None:
                            q, scale, dequant = channel_weight(w)
                        call, runner = channel_linear(x, q, scale)
                    else:
                        linear = fp8_utils.dispatch_w8a8_block_fp8_linear()
                        call = functools.partial(linear, input=x, weight=q, block_size=[128, 128], weight_scale=scale)
                        runner = getattr(linear, "__name__", str(linear))
                    bf16 = functools.partial(torch.matmul, x, dequant.t())
                    out, want = call(), bf16()
                    row["rel_err"] = float((out.float() - want.float()).norm() / want.float().norm())
                    row["us"] = 1e6 * timed_cuda(call)
                    row["bf16_us"] = 1e6 * timed_cuda(bf16)
                    row["runner"] = runner
                except Exception as err:  # a backend this GPU or bundle cannot run: recorded as such
                    row["error"] = error_text(err)
                else:  # as SGLang decodes: one CUDA graph replay, without the host's launch overhead
                    for key, fn, what in (("graph_us", call, ""), ("bf16_graph_us", bf16, "bf16: ")):
                        try:
                            row[key] = 1e6 * timed_cuda_graph(fn)
                        except Exception as err:  # capture refused (a sync or host work inside): eager kept
                            row.setdefault("graph_error", what + error_text(err))
                    if choice == CHANNEL and m == 256:  # once a layer: the weight's quantisation, not the input's
                        try:
                            row.update(agreement_with_core(w, q, scale))
                        except Exception as err:
                            row["core_error"] = error_text(err)
                rows.append(row)
                print(f"{choice:>20} {name:>12} m={m:<5} {gemm_line(row)}", flush=True)
    return rows


# SGLang's other FP8 linear: a bf16 checkpoint served with --quantization fp8 is quantised per output channel
# at load and runs sgl-kernel's CUTLASS scaled-mm with per-token activation scales where the GPU has it
# (fp8.py's process_weights_after_loading and apply_fp8_linear), not the block kernels above
CHANNEL = "channel (--quantization fp8)"


def channel_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w`` [N, K] as SGLang's online FP8 quantises it at load: (FP8 [N, K], float32 scales [N, 1], the weight
    dequantised to bf16)."""
    from sglang.kernels.ops.quantization.fp8_kernel import per_token_group_quant_fp8

    q, scale = per_token_group_quant_fp8(w, w.shape[-1])  # one group a row: a scale per output channel
    return q, scale, (q.float() * scale.float()).to(torch.bfloat16)


def channel_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor):
    """(call, runner name): ``x`` through the weight of `channel_weight` as SGLang's online FP8 applies it."""
    from sglang.srt.layers.quantization.fp8_utils import apply_fp8_linear, cutlass_fp8_supported

    cutlass = cutlass_fp8_supported()
    call = functools.partial(apply_fp8_linear, input=x, weight=q.t(), weight_scale=scale.t().contiguous(),
                             input_scale=None, cutlass_fp8_supported=cutlass)
    return call, f"apply_fp8_linear ({'CUTLASS' if cutlass else 'torch._scaled_mm'})"


def agreement_with_core(w: torch.Tensor, theirs: torch.Tensor, their_scale: torch.Tensor) -> dict:
    """How SGLang's per-channel quantisation of ``w`` (`channel_weight`: ``theirs``, ``their_scale``) compares
    with core's `quantize_channel`: the share of FP8 bytes that differ and the largest relative scale
    difference. A sync that lets the engine quantise (``--load-format flash_rl``) can check the engine's bytes
    only where these are 0."""
    from slime_rl.core.weights.fp8 import quantize_channel

    ours, our_scale = quantize_channel(w)
    differ = (theirs.view(torch.uint8) != ours.view(torch.uint8)).float().mean()
    return {"core_fp8_bytes_differ": float(differ),
            "core_scale_max_rel": float(((their_scale.float() - our_scale) / our_scale).abs().max())}


def error_text(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"


def gemm_line(row: dict) -> str:
    """One gemm row as the bench prints it: eager and CUDA-graph microseconds, FP8 vs bf16."""
    if "error" in row:
        return row["error"]
    graphed = (f"graphed {row['graph_us']:.0f} us (bf16 {row['bf16_graph_us']:.0f} us)"
               if "graph_us" in row and "bf16_graph_us" in row else f"graphed: {row.get('graph_error', '-')}")
    core = (f"; against core's quantize_channel: {100 * row['core_fp8_bytes_differ']:.3f}% of bytes differ, scales"
            f" within {row['core_scale_max_rel']:.1e}" if "core_fp8_bytes_differ" in row
            else f"; core: {row['core_error']}" if "core_error" in row else "")
    return (f"{row['runner']}: rel err {row['rel_err']:.2e},"
            f" eager {row['us']:.0f} us (bf16 {row['bf16_us']:.0f} us), {graphed}{core}")


def timed_cuda(fn, repeats: int = 20) -> float:
    """Seconds per eager call: the host's launch overhead included (Python, the Triton launcher)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def timed_cuda_graph(fn, repeats: int = 20) -> float:
    """Seconds per replay of one call of ``fn`` captured into a CUDA graph, as SGLang runs its decode batches
    (warm-up on a side stream, then capture: PyTorch's CUDA-graph recipe). Raises where capture fails."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()  # the output lives in the graph's pool; held while it replays
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / repeats
    del out, graph
    return seconds


# ---------------------------------------------------------------------- rollout

def model_folder(work: Path, shape: str, fp8: bool) -> Path:
    """The shape's HF folder (a large one without weights: its server makes dummy ones, `dummy_flags`); with
    ``fp8`` its FP8 copy as the engines start from it (rollout_sglang/fp8.py), or the config with the FP8
    quantization_config when there are no weights to quantise."""
    from weight_sync import make_model_folder

    from slime_rl.rollout_sglang.fp8 import fp8_format, write_served_folder

    base = work / shape
    if not (base / "config.json").is_file():
        make_model_folder(shape, base)
    if not fp8:
        return base
    folder = work / f"{shape}-fp8"
    if any(base.glob("*.safetensors")):
        return write_served_folder(base, folder, fp8_format(base, 1))
    if not folder.is_dir():
        shutil.copytree(base, folder)
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"] = fp8_format(base, 1).quantization_config()
        (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def dummy_flags(folder: Path) -> dict:
    """SGLang's random weights for a folder without any (``--load-format dummy``)."""
    return {} if any(folder.glob("*.safetensors")) else {"load_format": "dummy"}


def rollout(args, work: Path) -> list[dict]:
    from rollout_throughput import sglang_alone

    from slime_rl.core.contracts import SamplingParams
    from slime_rl.rollout_sglang.server import start_server, wait_healthy

    rows = []
    params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, ignore_eos=True)
    rng = random.Random(0)

    def prompts(count: int) -> list[list[int]]:
        return [[rng.randrange(10, 150_000) for _ in range(args.prompt_len)] for _ in range(count)]

    for variant in args.variants:
        folder = model_folder(work, args.shape, fp8=variant in ("fp8", "fp8-kv"))
        flags = dict(FLAGS, **dummy_flags(folder), **(args.engine_args or {}))
        if variant == "fp8-kv":
            flags["kv_cache_dtype"] = "fp8_e4m3"
        if variant == "fp8-channel":  # the bf16 folder, quantised by SGLang at load: per channel (see CHANNEL)
            flags["quantization"] = "fp8"
        server = start_server(0, str(folder), log_dir=work / f"logs-{variant}", python=args.python, engine_args=flags)
        try:
            t0 = time.perf_counter()
            wait_healthy(server, args.startup_timeout)
            started = time.perf_counter() - t0
            asyncio.run(sglang_alone(server.url, prompts(args.concurrency), params, args.concurrency))  # warm-up
            batch = prompts(args.requests)
            start = time.perf_counter()
            tokens = asyncio.run(sglang_alone(server.url, batch, params, args.concurrency))
            seconds = time.perf_counter() - start
            # the same count of new prompts (no cached prefix) for one token each: the prefill's part of the
            # run, which FP8 weights speed only through the GEMMs, apart from the decode's, which they and an FP8
            # KV cache speed by bytes read (docs/fp8.md)
            start = time.perf_counter()
            asyncio.run(sglang_alone(server.url, prompts(args.requests), replace(params, max_new_tokens=1),
                                     args.concurrency))
            prefill_s = time.perf_counter() - start
        finally:
            server.process.stop()
        row = {"mode": "rollout", "shape": args.shape, "variant": variant, "tokens": tokens, "seconds": seconds,
               "tokens_per_s": tokens / seconds, "prefill_s": prefill_s, "startup_s": started, "flags": flags}
        rows.append(row)
        print(f"[rollout] {variant}: {tokens} new tokens in {seconds:.1f} s = {tokens / seconds:,.0f} tok/s; "
              f"the prompts' prefill alone {prefill_s:.1f} s (server up in {started:.0f} s)", flush=True)
    return rows


# ---------------------------------------------------------------------- sync

def sync(args, work: Path) -> list[dict]:
    from weight_sync import GPU_ENGINE_ARGS, bucketed, trainer_weights

    from slime_rl.core.config import Config
    from slime_rl.core.weights.fp8 import quantize_named
    from slime_rl.rollout_sglang.engine import SGLangEngine
    from slime_rl.rollout_sglang.weights import verify
    from slime_rl.rollout_sglang.weights.trainer_sender import SGLangWeightSender

    rows, on_cuda = [], args.device == "cuda"
    for variant in ("bf16", "fp8"):
        folder, base = model_folder(work, args.shape, fp8=variant == "fp8"), model_folder(work, args.shape, fp8=False)
        flags = dict(GPU_ENGINE_ARGS, mem_fraction_static=0.3, **dummy_flags(folder)) if on_cuda else {}
        engine = SGLangEngine.launch(str(folder), engine_args=flags, python=args.python, work_dir=work / f"sync-{variant}",
                                     startup_timeout=args.startup_timeout, health_interval=0)
        try:
            weights = trainer_weights(base, args.device)
            buckets = bucketed(weights, 2048 * 2**20)
            cfg = Config.model_validate({
                "model": {"path": str(base)}, "logging": {"dir": str(work / f"run-{variant}")},
                "rollout": {"engine": "sglang", "update_weight_transport": "tensor",
                            "precision": "fp8" if variant == "fp8" else "model"}})
            sender = SGLangWeightSender(cfg, rank=0)  # with the restore copy, as the loop runs it
            seconds = []
            for version in range(1, args.syncs + 2):
                synchronize(on_cuda)
                start = time.perf_counter()
                asyncio.run(loop_sync(engine, sender, buckets, version))
                synchronize(on_cuda)
                seconds.append(time.perf_counter() - start)
                sender.restore.writes.wait()  # the background host copy, untimed (the loop trains meanwhile)
            sent = quantize_named(weights, sender.fp8) if sender.fp8 is not None else weights
            checked = sum(verify.check_weights(t, verify.check_sample(sent, every=True), timeout=600, step="check")
                          for t in engine.targets())
        finally:
            asyncio.run(engine.shutdown())
        median = statistics.median(seconds[1:])
        rows.append({"mode": "sync", "shape": args.shape, "variant": variant, "seconds": seconds[1:],
                     "median_s": median, "checked": checked})
        print(f"[sync] {variant}: {' '.join(f'{s:.3f}' for s in seconds[1:])} s (first {seconds[0]:.3f});"
              f" checksums equal: {checked} tensors", flush=True)
        del weights, buckets
        if on_cuda:
            torch.cuda.empty_cache()
    return rows


def synchronize(on_cuda: bool) -> None:
    if on_cuda:
        torch.cuda.synchronize()


async def loop_sync(engine, sender, buckets, version: int) -> None:
    """One sync as the training loop makes it: hold, trainer rank 0 pushes, let go."""
    targets = await engine.begin_weight_sync(version, transport="tensor")
    sender.send(iter(buckets), targets, version=version, transport="tensor")
    await engine.end_weight_sync(version)


# ---------------------------------------------------------------------- table

def table(rows: list[dict]) -> None:
    rollouts = {r["variant"]: r for r in rows if r["mode"] == "rollout"}
    if rollouts:
        base = rollouts.get("bf16")
        print(f"\n| rollout ({next(iter(rollouts.values())).get('shape', SHAPE)} shape) | new tokens/s | vs bf16 |"
              " run s | the prompts' prefill alone, s |\n|---|---|---|---|---|")
        for variant, r in rollouts.items():
            ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
            prefill = f"{r['prefill_s']:.1f}" if "prefill_s" in r else "-"  # JSON from before it was timed
            print(f"| {variant} | {r['tokens_per_s']:,.0f} | {ratio} | {r['seconds']:.1f} | {prefill} |")
        if base and "fp8" in rollouts:
            print(f"FP8 / bf16 = {rollouts['fp8']['tokens_per_s'] / base['tokens_per_s']:.2f} (target >= 1.3)")
    syncs = {r["variant"]: r for r in rows if r["mode"] == "sync"}
    if syncs:
        print(f"\n| {next(iter(syncs.values())).get('shape', SHAPE)} sync (CUDA IPC, 2 GiB buckets) | median s |"
              " checksums equal |\n|---|---|---|")
        for variant, r in syncs.items():
            print(f"| {variant}{' (quantised at each sync)' if variant == 'fp8' else ''} | {r['median_s']:.3f} |"
                  f" {r['checked']} |")
        if {"bf16", "fp8"} <= set(syncs):
            ratio = syncs["fp8"]["median_s"] / syncs["bf16"]["median_s"]
            print(f"FP8 / bf16 = {ratio:.2f} (target <= 1.5); FP8 {syncs['fp8']['median_s']:.3f} s (target <= 0.75)")
    gemms = [r for r in rows if r["mode"] == "gemm"]
    if gemms:
        print("\nus per call, FP8/bf16, for qkv, o, gate_up, down; graphed: one CUDA graph replay, as SGLang"
              " decodes; eager: the host's launches included")
        print("\n| --fp8-gemm-backend | usable | runner | decode (256 rows) eager | decode graphed |"
              " prefill (8192 rows) eager | prefill graphed |\n|---|---|---|---|---|---|---|")
        for backend in dict.fromkeys(r["backend"] for r in gemms):
            mine = [r for r in gemms if r["backend"] == backend]
            errors = [r["error"] for r in mine if "error" in r]
            usable = "no: " + errors[0] if errors else "yes"
            runner = next((r["runner"] for r in mine if "runner" in r), "-")
            cells = [gemm_times([r for r in mine if r["m"] == m], graphed) for m in (256, 8192)
                     for graphed in (False, True)]
            print(f"| {backend} | {usable} | {runner} | {' | '.join(cells)} |")


def gemm_times(rows: list[dict], graphed: bool) -> str:
    """A table cell: FP8/bf16 microseconds per layer ('-' where a row has none: an error, or JSON from before
    the graphed timing); a capture error instead when no layer was graphed."""
    fp8, bf16 = ("graph_us", "bf16_graph_us") if graphed else ("us", "bf16_us")
    times = [f"{r[fp8]:.0f}/{r[bf16]:.0f}" if fp8 in r and bf16 in r else "-" for r in rows]
    if not any(t != "-" for t in times):
        errors = [r["graph_error"] for r in rows if graphed and "graph_error" in r]
        return "no: " + errors[0] if errors else "-"
    return ", ".join(times)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["gemm", "rollout", "sync", "table"])
    p.add_argument("files", nargs="*", type=Path, help="table: JSON files of earlier calls")
    p.add_argument("--shape", default=SHAPE, help="a shape of benchmarks/weight_sync.py (tiny: the CPU smoke test)")
    p.add_argument("--device", default="cuda", help="the trainer's weights (sync; cpu with --python a stand-in)")
    p.add_argument("--variants", nargs="+", default=["bf16", "fp8", "fp8-kv"],
                   choices=["bf16", "fp8", "fp8-kv", "fp8-channel"])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--syncs", type=int, default=3, help="timed syncs per variant, after one untimed")
    p.add_argument("--engine-args", type=json.loads, default=None, help="extra server flags for every variant")
    p.add_argument("--python", default=sys.executable, help="interpreter that has SGLang")
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--work-dir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None, help="append the rows here")
    args = p.parse_args(argv)
    if args.mode == "table":
        table([row for f in args.files for row in json.loads(f.read_text())])
        return
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="fp8-bench-"))
    rows = {"gemm": gemm, "rollout": lambda a: rollout(a, work), "sync": lambda a: sync(a, work)}[args.mode](args)
    rows_out(args.json, rows)
    table(rows)


if __name__ == "__main__":
    main()
