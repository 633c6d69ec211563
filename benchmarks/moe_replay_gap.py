"""Rollout routing replay (issue 19): the engine's vs the Megatron trainer's log-probs of the same sampled tokens,
with the trainer routing on its own and with it replaying the engine's experts.

    python benchmarks/moe_replay_gap.py                                   # the H200 run: SGLang, bf16, 16 x 64 tokens
    python benchmarks/moe_replay_gap.py --engine hf --device cpu --shape tiny-moe --prompts 4 --new-tokens 8
                                                                          # the CPU smoke test (fp32)
    python benchmarks/moe_replay_gap.py --shape deepseek-v3-reduced       # issue 37's H200 run (stage deepseek-replay)
    python benchmarks/moe_replay_gap.py --engine hf --device cpu --shape tiny-deepseek-v3 --prompts 4 --new-tokens 8

The model: a random Qwen3-MoE or DeepSeek-V3 of ``--shape`` (benchmarks/trainer_throughput.py's shape table and
model maker; ``qwen3-30b-a3b-reduced`` is Qwen3-30B-A3B's hidden size, heads, 128 experts, top-8 and expert size with
4 layers; ``deepseek-v3-reduced`` a dense first layer and 3 MoE layers of 64 experts, top-6 of 3 of 8 groups, with
MLA: benchmarks/deepseek_shapes.py, whose routers get a random correction bias as a trained checkpoint has one),
saved in ``--dtype`` under ``--work-dir``. DeepSeek's dense first layer routes nothing: SGLang (its capture buffers
start as zeros and no router writes that layer's row) and the HF engine report zeros there, and the trainer replays
only its MoE layers' rows. The engine (``--engine sglang``: a real SGLang server started by
`SGLangEngine` with ``--enable-return-routed-experts``; ``hf``: the in-process transformers engine) samples
``--new-tokens`` tokens (eos ignored, temperature 1) after each of ``--prompts`` random prompts, through the loop's
own `generate_single_turn` with ``algorithm.routing_replay: rollout``: each sample carries the engine's log-probs
and the experts every token went to in every layer. The engine is shut down, then `MegatronTrainer` (same
weights, same dtype) computes the log-probs of exactly those tokens with `compute_log_probs` three times:

- off: the batch without routed experts (the trainer's routers choose);
- on: the batch with the engine's routed experts (the routers replay them);
- control: the engine's experts shifted by one (expert e -> e + 1): the log-probs must move, which shows the
  trainer's forward used the experts the batch carried (a replay that silently routed on its own would not).

Printed: tokens, mean and max |engine - trainer| off and on, and off / on (issue 19's target: replay cuts the
mean gap at least in half; measured, not asserted). Exits 1 when no routed experts came back for some sample or
the control did not move the log-probs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from colocated_step import GPU_ENGINE_ARGS, NO_CUDA_GRAPHS  # sibling scripts
from trainer_throughput import MOE, SHAPES, init_single_rank, make_model

from slime_rl.core.batch import RolloutBatch
from slime_rl.core.config import Config, load_config
from slime_rl.core.sample import Sample

TARGET_RATIO = 2.0  # issue 19: replay cuts the mean gap at least in half


@dataclass
class GapResult:
    tokens: int
    mean_off: float
    mean_on: float
    max_off: float
    max_on: float
    control_shift: float  # mean |on - control|: how far replaying other experts moves the log-probs

    @property
    def ratio(self) -> float:
        return self.mean_off / self.mean_on if self.mean_on > 0 else float("inf")


def bench_config(args, model_dir: Path) -> Config:
    on_cuda = args.device == "cuda"
    engine_args: dict = {}
    if args.engine == "sglang" and on_cuda:
        # a KV pool of 64k tokens (the run needs 1.5k) keeps SGLang's pinned host copy of routed experts small
        engine_args = dict(GPU_ENGINE_ARGS, **NO_CUDA_GRAPHS, mem_fraction_static=args.mem_fraction,
                           max_total_tokens=65536)
    overrides = [f"model.path={model_dir}", f"model.dtype={args.dtype}", f"cluster.device={args.device}",
                 f"rollout.engine={args.engine}",
                 "rollout.temperature=1.0", f"rollout.max_response_len={args.new_tokens}",
                 "algorithm.routing_replay=rollout", f"logging.dir={args.work_dir / 'logs'}", "data.source=none"]
    if args.engine == "sglang":
        overrides.append(f"rollout.sglang.server_args={json.dumps(engine_args)}")
    if args.engine_python:
        overrides.append(f"rollout.sglang.engine_python={args.engine_python}")
    if args.tokenizer_path:
        overrides.append(f"model.tokenizer_path={args.tokenizer_path}")
    return load_config(None, overrides, check=False)


def random_prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[Sample]:
    gen = torch.Generator().manual_seed(seed)
    return [Sample(index=i, group_index=i, tokens=torch.randint(3, vocab, (length,), generator=gen).tolist(), reward=0.0)
            for i in range(count)]


def sample_with_engine(cfg: Config, samples: list[Sample]) -> list[Sample]:
    """The loop's rollout of each prompt (one engine call each, all at once); the engine is shut down after."""
    from slime_rl.core.infra.plugins import load_plugin
    from slime_rl.core.run.rollout import generate_single_turn, sampling_params

    engine = load_plugin("slime_rl.rollout_engines", cfg.rollout.engine).from_config(cfg)
    params = replace(sampling_params(cfg), ignore_eos=True)  # every response exactly --new-tokens long

    async def run_all() -> list[Sample]:
        return list(await asyncio.gather(*(generate_single_turn(s, params, engine) for s in samples)))

    try:
        return asyncio.run(run_all())
    finally:
        asyncio.run(engine.shutdown())


def missing_experts(samples: list[Sample]) -> list[str]:
    """Why each sample without the engine's experts for every token it fed lacks them."""
    return [f"sample {s.index}: {len(s.rollout_routed_experts)} routed-expert rows for {len(s.tokens)} tokens"
            for s in samples if len(s.rollout_routed_experts) not in (len(s.tokens) - 1, len(s.tokens))]


def trainer_gaps(cfg: Config, samples: list[Sample], num_experts: int) -> GapResult:
    from slime_rl.trainer_megatron.trainer import MegatronTrainer

    init_single_rank()
    trainer = MegatronTrainer.from_config(cfg)
    batch = RolloutBatch.from_samples(samples)
    assert batch.routed_experts is not None  # missing_experts() let every sample through
    shifted = ((batch.routed_experts.long() + 1) % num_experts).to(batch.routed_experts.dtype)
    off = trainer.compute_log_probs(replace(batch, routed_experts=None)).float().cpu()
    on = trainer.compute_log_probs(batch).float().cpu()
    control = trainer.compute_log_probs(replace(batch, routed_experts=shifted)).float().cpu()
    engine = batch.rollout_log_probs.float()
    gap_off, gap_on = (engine - off).abs(), (engine - on).abs()
    return GapResult(tokens=gap_off.numel(), mean_off=float(gap_off.mean()), mean_on=float(gap_on.mean()),
                     max_off=float(gap_off.max()), max_on=float(gap_on.max()),
                     control_shift=float((on - control).abs().mean()))


def report(args, result: GapResult) -> None:
    print(f"\n## {args.engine} vs Megatron log-probs, {args.shape} ({args.dtype}, {args.device}):"
          f" {args.prompts} prompts x {args.new_tokens} sampled tokens, temperature 1")
    print("| tokens | mean abs gap, replay off | mean abs gap, replay on | off / on | max gap off | max gap on |")
    print("|---|---|---|---|---|---|")
    print(f"| {result.tokens} | {result.mean_off:.3e} | {result.mean_on:.3e} | {result.ratio:.2f}x"
          f" | {result.max_off:.3e} | {result.max_on:.3e} |")
    verdict = "met" if result.ratio >= TARGET_RATIO else "not met"
    print(f"replay cuts the mean gap {result.ratio:.2f}x (issue 19's target >= {TARGET_RATIO:.0f}x): {verdict}")
    print(f"control (engine's experts shifted by one): mean |log-prob change| {result.control_shift:.3e}")


def main(argv: list[str] | None = None) -> GapResult:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=["sglang", "hf"], default="sglang")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--shape", choices=sorted(MOE), default="qwen3-30b-a3b-reduced")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--mem-fraction", type=float, default=0.3, help="SGLang --mem-fraction-static")
    p.add_argument("--engine-python", default=None, help="interpreter that runs sglang.launch_server")
    p.add_argument("--tokenizer-path", default=None, help="model.tokenizer_path (the model is made without one)")
    p.add_argument("--work-dir", type=Path, default=None, help="the model and logs go here (default: a temp dir)")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="moe-replay-gap-"))
    if args.device == "cpu":
        torch.set_num_threads(1)

    started = time.perf_counter()
    model_dir = make_model(args.shape, args.work_dir / f"{args.shape}-{args.dtype}", dtype=getattr(torch, args.dtype))
    print(f"[moe-replay] model in {model_dir} at {time.perf_counter() - started:.0f} s", flush=True)
    cfg = bench_config(args, model_dir)
    samples = sample_with_engine(cfg, random_prompts(args.prompts, args.prompt_len, SHAPES[args.shape][1]))
    print(f"[moe-replay] {args.engine} sampled {sum(s.response_length for s in samples)} tokens; engine shut down"
          f" at {time.perf_counter() - started:.0f} s", flush=True)
    if missing := missing_experts(samples):
        print("FAIL: the engine returned no routed experts for some samples, so replay has nothing to use:\n  "
              + "\n  ".join(missing[:5]), file=sys.stderr)
        raise SystemExit(1)
    result = trainer_gaps(cfg, samples, num_experts=MOE[args.shape][0])
    print(f"[moe-replay] trainer's three log-prob passes done at {time.perf_counter() - started:.0f} s", flush=True)
    report(args, result)
    if result.control_shift == 0.0:
        print("FAIL: replaying other experts left every log-prob unchanged: the trainer did not use the batch's"
              " routed experts", file=sys.stderr)
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
