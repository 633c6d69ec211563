"""Where one MoE update of the Megatron trainer goes: ops, kernels, host syncs and each MoE piece's time.

CPU (checked here, a random tiny Qwen3-MoE):
    python benchmarks/moe_step_profile.py --device cpu --shape tiny-moe --dtype float32
GPU (stage ``bench-moe-ab`` of scripts/gpu/run.sh, bench-moe's batch):
    python benchmarks/moe_step_profile.py --device cuda --shape qwen3-30b-a3b-reduced --samples 16 \\
        --prompt-len 512 --response-len 512 --micro-batch-size 8 --variants as-is megatron-dispatch

One trainer is built; each variant switches a code path of it in place, then runs ``--warmup`` updates
and ``--steps`` timed ones (``compute_log_probs`` then ``train_step``, as trainer_throughput.py times
them) and one profiled update. Variants:

- ``as-is``: the trainer as it is;
- ``rope-per-sequence``: packed RoPE as before 82d8156, one compiled call per sequence, no host copy;
- ``rope-device-positions``: today's one call per row, its position index built on the device (no
  host-to-device copy, which syncs the stream);
  both replace the packed (thd) RoPE only: they change nothing unless ``--max-tokens-per-gpu`` packs the
  micro-batches (bench-moe's, by ``--micro-batch-size`` alone, are padded);
- ``megatron-dispatch``: megatron-core's alltoall dispatcher as it is (its device-to-host copy of the
  token counts and a stream sync per layer, its identity sort over the local experts) instead of
  moe.LocalDispatcher.

Per phase it prints the wall time, aten ops, device kernels, host syncs (CUDA: torch's sync debug
mode plus CUDA event and device synchronizes; CPU: the ops that would sync on a GPU: item, nonzero,
masked_select, repeat_interleave), then the time of each MoE piece (forward; the backward is in the
top ops) and the top ops of the train step by self device time.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trainer_throughput import MOE, SHAPES, make_model, make_samples, megatron_batch, megatron_trainer  # noqa: E402

# ops that read a device value on the host (a stream sync on CUDA)
HOST_READ_OPS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::repeat_interleave")
DISPATCH_STEPS = ("dispatch_preprocess", "token_dispatch", "dispatch_postprocess", "combine_preprocess",
                  "token_combine", "combine_postprocess")
VARIANTS = ("as-is", "rope-per-sequence", "rope-device-positions", "megatron-dispatch")


# ---------------------------------------------------------------- the variants' code paths


def rope_per_sequence(t, cu_seqlens, freqs, cp_size=1, cp_rank=0, interleaved=False):
    """fused_rope.rope_thd at 4342bcc: one compiled call per packed sequence."""
    from slime_rl.trainer_megatron.device import compiled
    from slime_rl.trainer_megatron.fused_rope import _rope

    bounds = cu_seqlens.tolist()
    out = torch.empty_like(t)
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        out[a:b] = compiled(_rope)(t[a:b].unsqueeze(1), freqs[: b - a]).squeeze(1)
    return out


def rope_device_positions(t, cu_seqlens, freqs, cp_size=1, cp_rank=0, interleaved=False):
    """Today's one call per row, the position index built where freqs live: the host sends the
    sequence starts and lengths without waiting (non_blocking), and repeat_interleave is told its size."""
    from slime_rl.trainer_megatron.device import compiled
    from slime_rl.trainer_megatron.fused_rope import _rope

    cu = cu_seqlens.long()
    starts, lengths = (x.to(freqs.device, non_blocking=True) for x in (cu[:-1], cu.diff()))
    positions = torch.arange(t.shape[0], device=freqs.device) - torch.repeat_interleave(
        starts, lengths, output_size=t.shape[0])
    return compiled(_rope)(t.unsqueeze(1), freqs[positions]).squeeze(1)


def use_variant(trainer, variant: str, rope_as_is) -> None:
    from megatron.core.models.common.embeddings import rope_utils

    if rope_as_is is not None:  # CUDA: the compiled RoPE is installed
        rope = {"rope-per-sequence": rope_per_sequence, "rope-device-positions": rope_device_positions}.get(
            variant, rope_as_is)

        def labelled_rope(*args, **kwargs):
            with torch.profiler.record_function("rope"):
                return rope(*args, **kwargs)

        rope_utils.fused_apply_rotary_pos_emb_thd = labelled_rope
    for dispatcher in dispatchers(trainer):
        if hasattr(dispatcher, "local"):  # moe.LocalDispatcher
            dispatcher.local = variant != "megatron-dispatch" and dispatcher.can_stay_local()


def dispatchers(trainer):
    return [m.token_dispatcher for m in trainer.model.modules() if hasattr(m, "token_dispatcher")]


# ---------------------------------------------------------------- labels and counters


@contextlib.contextmanager
def labelled_moe(trainer):
    """Each MoE piece's forward under a profiler label: router, the dispatcher's six steps, experts."""
    from megatron.core.transformer.moe.router import TopKRouter

    undo = []
    for module in trainer.model.modules():
        name = ("moe/router" if isinstance(module, TopKRouter) else "moe/experts" if
                type(module).__name__ in ("GroupedExperts", "SequentialMLP") else "attention" if
                type(module).__name__ == "SelfAttention" else None)
        if name is None:
            continue
        ranges = []
        pre = module.register_forward_pre_hook(
            lambda m, a, name=name, ranges=ranges: ranges.append(torch.profiler.record_function(name).__enter__()))
        post = module.register_forward_hook(lambda m, a, o, ranges=ranges: ranges.pop().__exit__(None, None, None))
        undo += [pre.remove, post.remove]
    for dispatcher in dispatchers(trainer):
        for step in DISPATCH_STEPS:
            real = getattr(dispatcher, step)

            def labelled(*args, real=real, step=step, **kwargs):
                with torch.profiler.record_function(f"moe/{step}"):
                    return real(*args, **kwargs)

            setattr(dispatcher, step, labelled)
            undo.append(lambda d=dispatcher, s=step: delattr(d, s))
    try:
        yield
    finally:
        for fn in undo:
            fn()


@contextlib.contextmanager
def counting_syncs(device: str, counter: collections.Counter):
    """CUDA: every host sync inside the block, by the Python line that made it: torch's sync debug mode
    (item, nonzero, blocking copies, stream and device synchronizes) and CUDA event synchronizes, which
    it does not see (megatron's dispatcher waits on one). Nothing on the CPU (the host-read ops count)."""
    if device != "cuda":
        yield
        return
    real_event_sync = torch.cuda.Event.synchronize

    def event_sync(self):
        frame = sys._getframe(1)
        counter[f"event.synchronize @ {Path(frame.f_code.co_filename).name}:{frame.f_lineno}"] += 1
        return real_event_sync(self)

    torch.cuda.Event.synchronize = event_sync
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
        for w in caught:
            if "synchroniz" in str(w.message):
                counter[f"{str(w.message).split(',')[0][:40]} @ {Path(w.filename).name}:{w.lineno}"] += 1
    finally:
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.Event.synchronize = real_event_sync


# ---------------------------------------------------------------- one variant


def device_time(evt) -> float:
    return getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)


def self_device_time(evt) -> float:
    return getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0.0)


def profile_phase(args, fn) -> dict:
    """Ops, kernels, host syncs and the MoE pieces' times of one call of ``fn``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    syncs: collections.Counter = collections.Counter()
    with profile(activities=activities) as prof:
        with counting_syncs(args.device, syncs):
            fn()
        if args.device == "cuda":
            torch.cuda.synchronize()
    events = prof.key_averages()
    cpu_ops = [e for e in events if e.key.startswith("aten::")]
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    host_reads = {e.key: e.count for e in cpu_ops if e.key in HOST_READ_OPS}
    pieces = {e.key: (e.count, e.cpu_time_total / 1e3, device_time(e) / 1e3) for e in events
              if e.key.startswith("moe/") or e.key in ("attention", "rope")}
    return dict(ops=sum(e.count for e in cpu_ops), kernels=sum(e.count for e in kernels), host_reads=host_reads,
                syncs=syncs, pieces=pieces, events=events)


def same_log_probs(trainer, batch, variants: list[str], rope_as_is) -> dict[str, float]:
    """Before any update (same weights): each variant's log-probs against the first's, max |difference|."""
    first = None
    diffs = {}
    for variant in variants:
        use_variant(trainer, variant, rope_as_is)
        log_probs = trainer.compute_log_probs(batch).float()
        first = log_probs if first is None else first
        diffs[variant] = float((log_probs - first).abs().max())
    print("log-probs of each variant against " + variants[0] + ", same weights (max |diff|): "
          + ", ".join(f"{v} {d:.3g}" for v, d in diffs.items()))
    return diffs


def run_variant(args, trainer, batch, variant: str, rope_as_is) -> dict:
    use_variant(trainer, variant, rope_as_is)

    def log_probs():
        batch.old_log_probs = trainer.compute_log_probs(batch)

    walls = {"compute_log_probs": [], "train_step": []}
    cpu = {"compute_log_probs": [], "train_step": []}  # this process's CPU seconds: ~wall when launch-bound
    for it in range(args.warmup + args.steps):
        for phase, fn in (("compute_log_probs", log_probs), ("train_step", lambda: trainer.train_step(batch))):
            if args.device == "cuda":
                torch.cuda.synchronize()
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            if args.device == "cuda":
                torch.cuda.synchronize()
            if it >= args.warmup:
                walls[phase].append(time.perf_counter() - start)
                cpu[phase].append(time.process_time() - start_cpu)
    with labelled_moe(trainer):
        profiles = {"compute_log_probs": profile_phase(args, log_probs),
                    "train_step": profile_phase(args, lambda: trainer.train_step(batch))}
    return dict(walls=walls, cpu=cpu, profiles=profiles)


def report(args, variant: str, result: dict, tokens: int) -> None:
    print(f"\n## {variant}: {args.shape} on {args.device} ({args.dtype}), {tokens} tokens per update")
    print("| phase | wall s (min / median) | CPU s (median) | tokens/s | aten ops | device kernels | host syncs |"
          " host-read ops |")
    print("|---|---|---|---|---|---|---|---|")
    for phase, prof in result["profiles"].items():
        walls = result["walls"][phase]
        reads = ", ".join(f"{k.split('::')[1]} {v}" for k, v in sorted(prof["host_reads"].items())) or "-"
        syncs = sum(prof["syncs"].values()) if args.device == "cuda" else "-"
        print(f"| {phase} | {min(walls):.4f} / {statistics.median(walls):.4f} |"
              f" {statistics.median(result['cpu'][phase]):.4f} | {tokens / min(walls):.0f} |"
              f" {prof['ops']} | {prof['kernels'] if args.device == 'cuda' else '-'} | {syncs} | {reads} |")
    for phase, prof in result["profiles"].items():
        if prof["syncs"]:
            print(f"\n{phase}: host syncs by where they happen")
            for where, n in prof["syncs"].most_common(12):
                print(f"    {n:5d}  {where}")
    train = result["profiles"]["train_step"]
    print("\n| MoE piece (train step forward) | calls | CPU ms | device ms |")
    print("|---|---|---|---|")
    for key in ("attention", "rope", "moe/router", *(f"moe/{s}" for s in DISPATCH_STEPS), "moe/experts"):
        if key in train["pieces"]:
            count, cpu_ms, dev_ms = train["pieces"][key]
            print(f"| {key} | {count} | {cpu_ms:.2f} | {dev_ms:.2f} |")
    if args.top:
        sort_by = "self_cuda_time_total" if args.device == "cuda" else "self_cpu_time_total"
        print(f"\ntrain step: top {args.top} ops by self {args.device} time")
        print(train["events"].table(sort_by=sort_by, row_limit=args.top, max_name_column_width=60))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--shape", choices=sorted(MOE), default="tiny-moe")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--response-len", type=int, default=16)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--max-tokens-per-gpu", type=int, default=None,
                   help="packed micro-batches of this token budget (default: by --micro-batch-size, padded)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--top", type=int, default=20, help="top ops of the train step (0: none)")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=["as-is"])
    p.add_argument("--model-dir", type=Path, default=None)
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    model_dir = make_model(args.shape, args.model_dir or Path(tempfile.gettempdir()) / f"slime-rl-bench-{args.shape}")
    samples = make_samples(args.samples, args.prompt_len, args.response_len, SHAPES[args.shape][1], jitter=0)
    batch = megatron_batch(samples)
    tokens = sum(len(s.tokens) for s in samples)
    trainer = megatron_trainer(model_dir, args)
    from megatron.core.models.common.embeddings import rope_utils

    rope_as_is = rope_utils.fused_apply_rotary_pos_emb_thd
    results = {"log_probs_vs_first": same_log_probs(trainer, batch, args.variants, rope_as_is)}
    for variant in args.variants:
        results[variant] = run_variant(args, trainer, batch, variant, rope_as_is)
        report(args, variant, results[variant], tokens)
    return results


if __name__ == "__main__":
    main()
