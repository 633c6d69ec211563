"""Megatron trainer vs plain transformers: step time, tokens/s, MFU, kernels per step, micro-batch
balance, and the log-prob pass's peak memory.

CPU (checked here, tiny or SmolLM2-shaped random models):
    python benchmarks/trainer_throughput.py --device cpu --shape smollm2-135m --threads 1 2
    python benchmarks/trainer_throughput.py --device cpu --shape tiny --mix --samples 16 \\
        --mix-prompt-len 10 50 --mix-response-len 10 350 --mix-response-median 60 --max-tokens-per-gpu 1024 \\
        --threads 1 --skip-memory
GPU (the H200 machine; scripts/gpu/run.sh stages bench-trainer, bench-trainer-packed, bench-trainer-short,
bench-moe, bench-trainer-mix): equal lengths, padded (like for like), RL-like lengths packed, and the
long-tailed RL mix (``--mix``):
    python benchmarks/trainer_throughput.py --device cuda --shape qwen2.5-1.5b --samples 16 \\
        --prompt-len 512 --response-len 512 --jitter 0 --micro-batch-size 16 --memory-tokens 16384
    python benchmarks/trainer_throughput.py --device cuda --shape qwen2.5-1.5b --samples 32 \\
        --prompt-len 256 --response-len 512 --jitter 240 --max-tokens-per-gpu 16384 \\
        --baseline-micro-batch-size 16 --skip-memory
    python benchmarks/trainer_throughput.py --device cuda --shape qwen2.5-1.5b --mix --samples 128 \\
        --max-tokens-per-gpu 16384 --skip-memory

Table 1: one GRPO update as the loop runs it: ``compute_log_probs`` (old policy) then
``train_step`` (forward, backward, Adam), next to transformers doing the same work on
the same batch (benchmarks/transformers_baseline.py: the same token-level loss, fused AdamW, SDPA
attention, bf16 autocast when the trainer runs bf16: always on CUDA, with --dtype bfloat16 on the
CPU, whose AMX units make bf16 matmuls ~4x faster than fp32). Which transformers baseline
(``--baseline``):
- ``padded`` (default for the fixed-length rows: like for like, short, packed, MoE):
  ``--baseline-micro-batch-size`` consecutive samples padded together, full fp32 log-softmax.
- ``sorted`` (default with ``--mix``): the best a user would write with transformers alone for
  long-tailed lengths: samples sorted by length into micro-batches of the trainer's token budget
  (``--max-tokens-per-gpu``, padded within a micro-batch), the LM head and log-softmax over the
  response positions only, in chunks of tokens recomputed in backward.
``--mix``: prompt and response lengths drawn (seeded) from a long-tailed distribution, printed as
p50/p90/p99/max: prompts uniform in ``--mix-prompt-len``, responses log-normal (median
``--mix-response-median``, ``--mix-sigma``; its quantiles, in a seeded order) clipped to
``--mix-response-len``: by default p50 512, p90 ~2.4k, p99 ~7.8k, max 8192 tokens of 128 samples.
MoE (``--shape tiny-moe``, ``--shape qwen3-30b-a3b-reduced``): the trainer's MoE layers next to
transformers' own Qwen3-MoE; params in the FLOPs below are the active ones (router + top-k experts).
DeepSeek-V3 (``--shape tiny-deepseek-v3``, ``--shape deepseek-v3-reduced``: deepseek_shapes.py; GPU stage
bench-deepseek): the trainer's MLA, dense first layer and grouped sigmoid routing next to transformers'
DeepseekV3ForCausalLM; the FLOPs count MLA's projections and its two head dims (deepseek_shapes.py), and the
header gives the GiB the two contenders' weights, gradients and Adam states take together.
Tokens/s counts every token of the batch per train step; MFU counts, for both contenders, the standard
6 * params FLOPs per token plus each sample's attention, 12 * layers * heads * head_dim * L_i per
token of a sample of L_i tokens (summed per sample: sum of L_i^2, not from the mean length), against
--peak-tflops (the trainer skips the LM head on prompt tokens and packs instead of padding: work the
formula counts that it never does, which is the point).
After the table, per contender: the kernels one ``train_step`` launches (CUDA kernels by
torch.profiler; on the CPU its leaf operators) and its micro-batches' balance: how many, the
max over micro-batches of tokens and of sum L_i^2 divided by the mean, and padded / real tokens
(the trainer's micro-batches as its train step made them with ``trainer_megatron.batching.group_rows``).

Table 2: peak memory the log-prob pass adds beyond the weights, at --memory-tokens
tokens: the trainer's chunked, fused head next to a naive full-logits pass
(fp32 logits of the whole batch, log_softmax, gather). CUDA: allocator peak;
CPU: peak RSS of a fresh process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import deepseek_shapes  # sibling scripts (with step_figures, transformers_baseline)
import torch
from deepseek_shapes import DEEPSEEK
from step_figures import balance, launches, percentiles
from transformers_baseline import SortedBudgetBaseline, TransformersBaseline

SHAPES = {
    # name: (family, vocab, hidden, intermediate, layers, heads, kv_heads, tied, rope_theta)
    "tiny": ("llama", 32768, 128, 352, 4, 4, 2, True, 10000.0),
    "smollm2-135m": ("llama", 49152, 576, 1536, 30, 9, 3, True, 100000.0),
    "qwen2.5-0.5b": ("qwen2", 151936, 896, 4864, 24, 14, 2, True, 1000000.0),
    "qwen2.5-1.5b": ("qwen2", 151936, 1536, 8960, 28, 12, 2, True, 1000000.0),
    # Qwen3-MoE shapes (the MOE table below adds experts); intermediate is unused (every layer is MoE)
    "tiny-moe": ("qwen3_moe", 32768, 128, 352, 4, 4, 2, True, 10000.0),
    "qwen3-30b-a3b-reduced": ("qwen3_moe", 151936, 2048, 6144, 4, 32, 4, False, 1000000.0),
    # DeepSeek-V3 shapes (deepseek_shapes.py: MLA, dense first layer, groups, shared expert); intermediate is
    # the dense first layer's
    "tiny-deepseek-v3": ("deepseek_v3", 32768, 128, 352, 4, 4, 4, False, 10000.0),
    "deepseek-v3-reduced": ("deepseek_v3", 32768, 2048, 10944, 4, 16, 16, False, 10000.0),
}
# MoE shapes: (experts, top-k, expert intermediate size, head_dim). qwen3-30b-a3b-reduced is
# Qwen3-30B-A3B's hidden size, heads, 128 experts, top-8 and expert size with 4 of its 48 layers.
# DeepSeek-V3 shapes have no one head_dim (MLA's q/k and v head dims differ: deepseek_shapes.DEEPSEEK).
MOE = {"tiny-moe": (8, 2, 96, 32), "qwen3-30b-a3b-reduced": (128, 8, 768, 128),
       "tiny-deepseek-v3": (8, 2, 96, None), "deepseek-v3-reduced": (64, 6, 1408, None)}


def make_model(shape: str, folder: Path, dtype: torch.dtype = torch.float32, positions: int = 32768) -> Path:
    """A random HF model of ``shape`` saved in ``folder`` (kept if already there), weights in ``dtype``,
    ``positions`` its max_position_embeddings."""
    import transformers

    if (folder / "config.json").is_file():
        return folder
    config = hf_config(shape, positions)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # random init of 1.5B is slow on a CPU
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    if shape in DEEPSEEK:
        deepseek_shapes.randomize_correction_bias(model)
    model.save_pretrained(folder)
    del model
    return folder


def hf_config(shape: str, positions: int = 32768):
    """The transformers config of ``shape`` (``positions`` its max_position_embeddings)."""
    import transformers

    family, vocab, hidden, inter, layers, heads, kv, tied, theta = SHAPES[shape]
    cfg_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "qwen3_moe": transformers.Qwen3MoeConfig, "deepseek_v3": transformers.DeepseekV3Config}[family]
    extra = {}
    if shape in DEEPSEEK:
        extra = deepseek_shapes.config_fields(shape, *MOE[shape][:3])
    elif shape in MOE:
        experts, topk, moe_inter, head_dim = MOE[shape]
        extra = dict(num_experts=experts, num_experts_per_tok=topk, moe_intermediate_size=moe_inter,
                     head_dim=head_dim, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    config = cfg_cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                     num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=tied,
                     max_position_embeddings=positions, rms_norm_eps=1e-6, **extra)
    config.rope_parameters = {"rope_type": "default", "rope_theta": theta}
    return config


def model_flops_per_token(shape: str, seq_len: int) -> float:
    """Training FLOPs of one token of a ``seq_len``-token sample: 6 x the (active) parameters plus
    its attention scores and values, 12 x layers x (heads x head_dim) x seq_len."""
    family, vocab, hidden, inter, layers, heads, kv, tied, _ = SHAPES[shape]
    if shape in DEEPSEEK:  # MLA's projections and head dims, dense first layers, shared experts
        params = deepseek_shapes.active_params_per_token(shape, vocab, hidden, inter, layers, heads, *MOE[shape][:3])
        return 6 * params + deepseek_shapes.attention_flops_per_token(shape, layers, heads, seq_len)
    head_dim = hidden // heads
    mlp = 3 * hidden * inter
    if shape in MOE:  # active parameters: the router and top-k experts of each token
        experts, topk, moe_inter, head_dim = MOE[shape]
        mlp = hidden * experts + 3 * hidden * moe_inter * topk
    attn = hidden * (heads + 2 * kv) * head_dim + heads * head_dim * hidden
    params = layers * (attn + mlp) + vocab * hidden  # the LM head's matmul; the embedding lookup is free
    # heads x head_dim, not hidden: Qwen3-30B-A3B's 32 heads of 128 are twice its hidden size
    return 6 * params + 12 * layers * heads * head_dim * seq_len


def model_flops(shape: str, lengths: list[int]) -> float:
    """Training FLOPs of a batch of samples of ``lengths`` tokens: each sample's attention from its
    own length (sum of L_i^2), not from the mean length."""
    return sum(model_flops_per_token(shape, n) * n for n in lengths)


def samples_of_lengths(prompts: list[int], responses: list[int], vocab: int, seed: int = 0):
    """Samples of random tokens with these prompt and response lengths, one advantage each (N(0, 1))."""
    from slime_rl.core.sample import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        tokens = torch.randint(0, vocab, (p + r,), generator=g).tolist()
        adv = float(torch.randn((), generator=g))
        out.append(Sample(index=i, group_index=i // 8, tokens=tokens, response_length=r, loss_mask=[1] * r,
                          rollout_log_probs=[0.0] * r, reward=adv, advantages=[adv] * r))
    return out


def make_samples(n: int, prompt_len: int, response_len: int, vocab: int, jitter: int, seed: int = 0):
    """``n`` samples of ``prompt_len`` and ``response_len`` tokens, each +- ``jitter`` (uniform)."""
    g = torch.Generator().manual_seed(seed)

    def around(length: int) -> int:
        return length + (int(torch.randint(-jitter, jitter + 1, (1,), generator=g)) if jitter else 0)

    prompts, responses = [], []
    for _ in range(n):
        prompts.append(around(prompt_len))
        responses.append(around(response_len))
    return samples_of_lengths(prompts, responses, vocab, seed)


def mix_lengths(n: int, prompt_range: tuple[int, int], response_range: tuple[int, int], median: float,
                sigma: float, seed: int = 0) -> tuple[list[int], list[int]]:
    """An RL batch's long tail: prompts uniform in ``prompt_range``; responses log-normal (``median``,
    ``sigma``) clipped to ``response_range``, so most are short and a few run to the cap. The responses
    are the distribution's n quantiles (i + 0.5) / n in a seeded order: every seed has the same tail
    (128 draws would put the longest anywhere from 4k to past the cap)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(prompt_range[0], prompt_range[1] + 1, (n,), generator=g)
    quantiles = torch.special.ndtri((torch.arange(n, dtype=torch.float64) + 0.5) / n)
    responses = (median * torch.exp(sigma * quantiles)).round().clamp(*response_range).long()
    return prompts.tolist(), responses[torch.randperm(n, generator=g)].tolist()


def bench_samples(args):
    """The benchmark's batch: the long-tailed mix (``--mix``) or lengths around the fixed ones."""
    vocab = SHAPES[args.shape][1]
    if args.mix:
        prompt_range, response_range = tuple(args.mix_prompt_len), tuple(args.mix_response_len)
        prompts, responses = mix_lengths(args.samples, prompt_range, response_range, args.mix_response_median,
                                         args.mix_sigma, args.seed)
        return samples_of_lengths(prompts, responses, vocab, args.seed)
    return make_samples(args.samples, args.prompt_len, args.response_len, vocab, args.jitter, args.seed)


def megatron_batch(samples):
    """The trainer's input: the samples as one `RolloutBatch` (one DP rank, one optimizer step), with
    the samples' advantages as its column."""
    from slime_rl.core.batch import RolloutBatch

    batch = RolloutBatch.from_samples(samples)
    batch.advantages = torch.tensor([a for s in samples for a in s.advantages], dtype=torch.float32)
    return batch


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of fn()."""
    sync(device)
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    sync(device)
    return time.perf_counter() - wall, time.process_time() - cpu


# ---------------------------------------------------------------- the two contenders


def init_single_rank() -> None:
    if not torch.distributed.is_initialized():
        from slime_rl.core.infra.net import free_port

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")


def megatron_trainer(model_dir: Path, args):
    from slime_rl.core.config import load_config
    from slime_rl.trainer_megatron.trainer import MegatronTrainer

    init_single_rank()
    overrides = [f"model.path={model_dir}", f"cluster.device={args.device}", "trainer.lr=1e-5",
                 f"model.dtype={args.dtype}",
                 f"trainer.micro_batch_size={args.micro_batch_size}", "trainer.adam_beta2=0.99"]
    if args.max_tokens_per_gpu:
        overrides.append(f"trainer.max_tokens_per_gpu={args.max_tokens_per_gpu}")
    return MegatronTrainer.from_config(load_config(None, overrides, check=False))


# ---------------------------------------------------------------- table 1


def make_baseline(args, model_dir: Path):
    autocast = args.dtype == "bfloat16"
    if args.baseline == "sorted":
        return SortedBudgetBaseline(model_dir, args.device, autocast,
                                    max_tokens=args.baseline_max_tokens or args.max_tokens_per_gpu)
    return TransformersBaseline(model_dir, args.device, autocast,
                                micro_batch_size=args.baseline_micro_batch_size or args.micro_batch_size)


def step_table(args, model_dir: Path, samples) -> tuple[list[dict], dict]:
    """(the table's rows, per contender: (kernel or op count of one train step, what it counts,
    micro-batch `Balance`)). One contender at a time, the first freed before the second is built: held at once,
    their weights, gradients and Adam states outgrew an H100 at the 1.5B and 30B-A3B-reduced shapes (both ran
    only on H200s); each contender's figures are still taken in the same process, on the same machine."""
    batch = megatron_batch(samples)
    lengths = [len(s.tokens) for s in samples]
    flops = model_flops(args.shape, lengths)
    rows, figures = [], {}
    for name, contender in (("megatron", megatron_contender), ("transformers", transformers_contender)):
        contender_rows, figures[name] = contender(args, model_dir, samples, batch, lengths, flops)
        rows += contender_rows
        free_device_memory(args.device, after=name)
    return rows, figures


def megatron_contender(args, model_dir: Path, samples, batch, lengths, flops) -> tuple[list[dict], tuple]:
    trainer = megatron_trainer(model_dir, args)
    grouped_mm_calls = {"calls": 0}

    def update() -> tuple[tuple[float, float], tuple[float, float]]:
        with counting_grouped_mm(grouped_mm_calls):
            lp = timed(lambda: setattr(batch, "old_log_probs", trainer.compute_log_probs(batch)), args.device)
            return lp, timed(lambda: trainer.train_step(batch), args.device)

    rows = timed_rows(args, "megatron", update, sum(lengths), flops)
    if args.shape in MOE:  # which experts the trainer ran, and whether the grouped GEMM served them
        experts = sorted({type(m).__name__ for n, m in trainer.model.named_modules() if n.endswith("mlp.experts")})
        updates = (args.warmup + args.steps) * len(args.threads if args.device == "cpu" else [None])
        print(f"MoE experts: {', '.join(experts)}; torch._grouped_mm calls per Megatron update:"
              f" {grouped_mm_calls['calls'] / updates:.0f}")
    # one more train step, profiled: what it launches (the old log-probs of the last timed update), and the
    # micro-batches the trainer made for it, as it made them
    trainer_groups: list[list[list[int]]] = []
    with recording_group_rows(trainer_groups):
        count, what = launches(lambda: trainer.train_step(batch), args.device)
    if not trainer_groups:
        raise RuntimeError("the trainer's train_step made its micro-batches without"
                           " trainer_megatron.batching.group_rows: update recording_group_rows")
    if args.profile:
        profile_update(args, "megatron", lambda: trainer.train_step(batch))
    return rows, (count, what, balance(trainer_groups[-1], lengths, padded=args.max_tokens_per_gpu is None))


def transformers_contender(args, model_dir: Path, samples, batch, lengths, flops) -> tuple[list[dict], tuple]:
    baseline = make_baseline(args, model_dir)
    holder: dict = {}  # the timed lambdas leave the log-probs here; each iteration overwrites them

    def update() -> tuple[tuple[float, float], tuple[float, float]]:
        lp = timed(lambda: holder.update(lp=baseline.log_probs(samples)), args.device)
        return lp, timed(lambda: baseline.train_step(samples, holder["lp"]), args.device)

    rows = timed_rows(args, "transformers", update, sum(lengths), flops)
    count, what = launches(lambda: baseline.train_step(samples, holder["lp"]), args.device)
    if args.profile:
        profile_update(args, "transformers", lambda: baseline.train_step(samples, holder["lp"]))
    return rows, (count, what, balance(baseline.groups(lengths), lengths, padded=True))


def timed_rows(args, name: str, update, tokens: int, flops: float) -> list[dict]:
    """``--warmup`` then ``--steps`` timed updates (``update()``: the (wall, CPU) seconds of the log-prob pass and
    of the train step) per thread count: the best of each, as one table row."""
    rows = []
    for threads in args.threads if args.device == "cpu" else [None]:
        if threads:
            torch.set_num_threads(threads)
        lp_times, train_times = [], []
        for it in range(args.warmup + args.steps):
            lp, tr = update()
            if it >= args.warmup:
                lp_times.append(lp)
                train_times.append(tr)
        # 1 thread on a shared CPU: CPU seconds are the steadier figure; otherwise wall time
        pick = 1 if (args.device == "cpu" and threads == 1) else 0
        lp_s = min(t[pick] for t in lp_times)
        tr_s = min(t[pick] for t in train_times)
        rows.append(dict(contender=name, threads=threads, log_probs_s=lp_s, train_step_s=tr_s,
                         total_s=lp_s + tr_s, train_tok_s=tokens / tr_s,
                         mfu=flops / tr_s / (args.peak_tflops * 1e12) if args.peak_tflops else None,
                         wall_train_s=statistics.median(t[0] for t in train_times)))
    return rows


def free_device_memory(device: str, *, after: str) -> None:
    """Release what a contender held before the next is built (its objects are gone with its function's frame)."""
    import gc

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        print(f"after {after}: peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB allocated, "
              f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB still held", flush=True)
        torch.cuda.reset_peak_memory_stats()


@contextlib.contextmanager
def recording_group_rows(calls: list):
    """Keep what ``trainer_megatron.batching.group_rows`` returns inside the block: the trainer's
    micro-batches (rows of each), made with the trainer's own arguments."""
    from slime_rl.trainer_megatron import batching

    real = batching.group_rows

    def recorded(*args, **kwargs):
        calls.append(real(*args, **kwargs))
        return calls[-1]

    batching.group_rows = recorded
    try:
        yield
    finally:
        batching.group_rows = real


@contextlib.contextmanager
def counting_grouped_mm(counter: dict):
    """Count the calls to torch._grouped_mm inside the block (the trainer's grouped experts)."""
    real = getattr(torch, "_grouped_mm", None)
    if real is None:
        yield
        return

    def counted(*args, **kwargs):
        counter["calls"] += 1
        return real(*args, **kwargs)

    torch._grouped_mm = counted
    try:
        yield
    finally:
        torch._grouped_mm = real


def profile_update(args, name: str, step) -> None:
    """Where one update's time goes: ``step()`` (one train step of contender ``name``), its top ops by self device
    time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    sort_by = "self_cuda_time_total" if args.device == "cuda" else "self_cpu_time_total"
    with profile(activities=activities) as prof:
        step()
        sync(args.device)
    print(f"\n## profile: one {name} train step, top {args.profile} ops by self {args.device} time")
    print(prof.key_averages().table(sort_by=sort_by, row_limit=args.profile, max_name_column_width=60))


# ---------------------------------------------------------------- table 2


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets the peak-RSS mark (VmHWM) to the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_probe(args, model_dir: Path, variant: str) -> int:
    """Bytes the log-prob pass adds beyond the loaded weights (run in its own process on CPU)."""
    vocab = SHAPES[args.shape][1]
    per_sample = args.memory_tokens // args.memory_samples
    samples = make_samples(args.memory_samples, per_sample // 2, per_sample - per_sample // 2, vocab, 0)
    if variant == "megatron":
        trainer = megatron_trainer(model_dir, argparse.Namespace(**{**vars(args), "micro_batch_size": args.memory_samples,
                                                                     "max_tokens_per_gpu": None}))
        batch = megatron_batch(samples)
        run = lambda: trainer.compute_log_probs(batch)  # noqa: E731
    else:
        baseline = TransformersBaseline(model_dir, args.device, autocast=False, micro_batch_size=args.memory_samples)
        if args.dtype == "bfloat16":
            baseline.model.to(torch.bfloat16)  # weights like the trainer's, so only the pass differs
        run = lambda: baseline.log_probs(samples)  # noqa: E731
    if args.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    reset_peak_rss()
    before = rss_bytes()
    run()
    return peak_rss_bytes() - before


def memory_table(args, model_dir: Path) -> list[dict]:
    rows = []
    for variant in ("megatron", "naive"):
        if args.device == "cuda":
            peak = memory_probe(args, model_dir, variant)
        else:  # a fresh process per variant: peak RSS cannot be reset
            cmd = [sys.executable, __file__, "--probe", variant, "--model-dir", str(model_dir)] + args.argv
            out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
            if out.returncode != 0:
                raise RuntimeError(f"memory probe {variant} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
            peak = json.loads(out.stdout.strip().splitlines()[-1])["peak"]
        rows.append(dict(variant=variant, peak_bytes=peak))
    vocab = SHAPES[args.shape][1]
    rows.append(dict(variant="(fp32 logits alone)", peak_bytes=args.memory_tokens * vocab * 4))
    return rows


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> tuple[list[dict], dict]:
    """Runs the tables; returns table 1's rows and the per-contender figures (tests read them)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=20)
    p.add_argument("--response-len", type=int, default=10)
    p.add_argument("--jitter", type=int, default=3, help="+- tokens of length variation per sample")
    p.add_argument("--micro-batch-size", type=int, default=32)
    p.add_argument("--max-tokens-per-gpu", type=int, default=None, help="packed dynamic micro-batches")
    p.add_argument("--baseline-micro-batch-size", type=int, default=None,
                   help="samples per transformers micro-batch (default: --micro-batch-size)")
    p.add_argument("--baseline", choices=["padded", "sorted"], default=None,
                   help="the transformers baseline (see above); default: sorted with --mix, else padded")
    p.add_argument("--baseline-max-tokens", type=int, default=None,
                   help="padded tokens per sorted-baseline micro-batch (default: --max-tokens-per-gpu)")
    p.add_argument("--mix", action="store_true",
                   help="long-tailed RL lengths (--mix-*) instead of --prompt-len/--response-len/--jitter")
    p.add_argument("--mix-prompt-len", type=int, nargs=2, default=[100, 500], metavar=("MIN", "MAX"))
    p.add_argument("--mix-response-len", type=int, nargs=2, default=[50, 8192], metavar=("MIN", "MAX"))
    p.add_argument("--mix-response-median", type=float, default=512.0)
    p.add_argument("--mix-sigma", type=float, default=1.2, help="log-normal sigma of the response lengths")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--peak-tflops", type=float, default=None, help="989 for an H200 (bf16 dense)")
    p.add_argument("--memory-tokens", type=int, default=8192)
    p.add_argument("--memory-samples", type=int, default=4)
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="print each contender's top N ops")
    p.add_argument("--model-dir", type=Path, default=None)
    p.add_argument("--probe", choices=["megatron", "naive"], default=None, help=argparse.SUPPRESS)
    args, unknown = p.parse_known_args(argv)
    if unknown:  # still tolerated, but said: a misspelt flag would otherwise pass unnoticed on the GPU machine
        print(f"warning: trainer_throughput.py ignores arguments no option takes: {unknown}", file=sys.stderr)
    args.argv = sys.argv[1:] if argv is None else argv  # the memory probes' processes get the same options
    if args.device == "cuda" and args.peak_tflops is None:
        args.peak_tflops = 989.0
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.baseline = args.baseline or ("sorted" if args.mix else "padded")
    if args.mix and not args.max_tokens_per_gpu:
        p.error("--mix runs the trainer packed with a token budget: set --max-tokens-per-gpu (e.g. 16384)")
    if args.baseline == "sorted" and not (args.baseline_max_tokens or args.max_tokens_per_gpu):
        p.error("--baseline sorted cuts micro-batches by tokens:"
                " set --max-tokens-per-gpu or --baseline-max-tokens")
    for name in ("mix_prompt_len", "mix_response_len"):
        low, high = getattr(args, name)
        if not 1 <= low <= high:
            p.error(f"--{name.replace('_', '-')} {low} {high}: need 1 <= MIN <= MAX")

    model_dir = args.model_dir or Path(tempfile.gettempdir()) / f"slime-rl-bench-{args.shape}"
    if args.probe:
        torch.set_num_threads(1)
        print(json.dumps({"peak": memory_probe(args, model_dir, args.probe)}))
        return [], {}
    make_model(args.shape, model_dir)
    if args.shape in DEEPSEEK:  # before the run: what an out-of-memory had to hold
        params = deepseek_shapes.hf_param_count(hf_config(args.shape))
        memory = deepseek_shapes.memory_estimate(params)
        print(f"{args.shape}: {params / 1e9:.2f}B parameters; weights, gradients and Adam states"
              f" {memory['trainer_gib']:.1f} GiB (ours), then {memory['baseline_gib']:.1f} GiB (transformers),"
              " before activations: one contender held at a time", flush=True)

    samples = bench_samples(args)
    rows, figures = step_table(args, model_dir, samples)
    tokens = sum(len(s.tokens) for s in samples)
    if args.mix:
        prompts = [len(s.tokens) - s.response_length for s in samples]
        lengths = (f"long-tailed mix, seed {args.seed}: prompt {percentiles(prompts)};"
                   f" response {percentiles([s.response_length for s in samples])};"
                   f" sample {percentiles([len(s.tokens) for s in samples])}")
    else:
        lengths = f"prompt ~{args.prompt_len}, response ~{args.response_len}"
    budget = f"; token budget {args.max_tokens_per_gpu}" if args.max_tokens_per_gpu else ""
    print(f"\n## {args.shape} on {args.device} ({args.dtype}): {args.samples} samples, {tokens} tokens per step"
          f" ({lengths}){budget}; transformers baseline: {args.baseline}")
    print("| contender | threads | compute_log_probs s | train_step s | total s | train tokens/s | MFU |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        print(f"| {r['contender']} | {r['threads'] or '-'} | {r['log_probs_s']:.3f} | {r['train_step_s']:.3f}"
              f" | {r['total_s']:.3f} | {r['train_tok_s']:.0f} | {mfu} |")
    by = {(r["contender"], r["threads"]): r for r in rows}
    for threads in sorted({r["threads"] for r in rows}, key=lambda t: t or 0):
        m, t = by[("megatron", threads)], by[("transformers", threads)]
        print(f"megatron / transformers tokens/s ({threads or 'gpu'} thread(s)): {m['train_tok_s'] / t['train_tok_s']:.2f}x;"
              f" whole update {t['total_s'] / m['total_s']:.2f}x")
    if args.device == "cpu":
        print("(1 thread: CPU seconds of the process; 2 threads: wall seconds)")
    else:  # each contender's peak is printed after it ran ("after megatron: peak ..."): the card's size beside them
        print(f"GPU memory: {torch.cuda.get_device_properties(0).total_memory / 2**30:.1f} GiB")
    what = next(iter(figures.values()))[1]
    print(f"\n| contender | {what} per train_step | micro-batches | tokens, max / mean"
          " | sum L_i^2, max / mean | padded / real tokens |")
    print("|---|---|---|---|---|---|")
    for name, (count, _, bal) in figures.items():
        print(f"| {name} | {count:,} | {bal.micro_batches} | {bal.tokens_max_over_mean:.2f}"
              f" | {bal.attention_max_over_mean:.2f} | {bal.padded_over_real:.2f} |")

    if not args.skip_memory:
        mem = memory_table(args, model_dir)
        print(f"\n## log-prob pass at {args.memory_tokens} tokens ({args.memory_samples} samples):"
              " peak memory beyond the weights")
        print("| pass | peak MiB |")
        print("|---|---|")
        for r in mem:
            print(f"| {r['variant']} | {r['peak_bytes'] / 2**20:.0f} |")
        print(f"trainer / naive: {mem[0]['peak_bytes'] / max(1, mem[1]['peak_bytes']):.2f} (target <= 0.25)")
    return rows, figures


if __name__ == "__main__":
    main()
