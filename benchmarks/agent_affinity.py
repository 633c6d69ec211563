"""Session affinity for multi-turn rollouts: the prefix-cache hit rate of the same episodes sent through
sglang-router with the agent's routing keys (policy ``manual``) and without them (``round_robin``).

    python benchmarks/agent_affinity.py                          # GPU: 2 SGLang servers on GPUs 0 and 1
    python benchmarks/agent_affinity.py --gpus 0 0               # 2 servers sharing one GPU
    python benchmarks/agent_affinity.py --python STANDIN --model-dir DIR --engine-args '{}'   # CPU stand-in

An episode is a random prompt, then ``--turns`` turns: the engine samples ``--new-tokens`` greedily (so both
policies see the same episodes), then an 'observation' of ``--obs-len`` fixed ids is appended, as the agent
loop does; turns go out with request ids ``<session>/<turn>``, which SGLangEngine sends as the router's
routing key. Both policies start on empty caches (flushed). The hit rate is what SGLang reports
(``meta_info.cached_tokens``) over the input tokens sent, as ``rollout/prefix_cache_hit_rate`` is.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

from slime_rl.core.contracts import SamplingParams
from slime_rl.rollout_sglang.engine import SGLangEngine
from slime_rl.rollout_sglang.server import start_server, wait_healthy

GPU_ENGINE_ARGS = {"skip_tokenizer_init": True, "attention_backend": "triton", "sampling_backend": "pytorch",
                   "grammar_backend": "none", "mem_fraction_static": 0.35}


async def run_episodes(engine: SGLangEngine, prompts: list[list[int]], args: argparse.Namespace,
                       keyed: bool) -> dict[str, float]:
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    observation = list(range(100, 100 + args.obs_len))
    sent = cached = later_sent = later_cached = 0

    async def episode(e: int, ids: list[int]) -> None:
        nonlocal sent, cached, later_sent, later_cached
        for turn in range(args.turns):
            rid = f"ep{e}/{turn}" if keyed else f"ep{e}-{turn}"
            out = await engine.generate(ids, params, request_id=rid)
            hit = out.cached_tokens or 0
            sent, cached = sent + len(ids), cached + hit
            if turn:
                later_sent, later_cached = later_sent + len(ids), later_cached + hit
            ids = ids + out.token_ids + observation

    start = time.perf_counter()
    await asyncio.gather(*(episode(e, list(p)) for e, p in enumerate(prompts)))
    return {"hit_rate": cached / sent, "later_turns_hit_rate": later_cached / max(later_sent, 1),
            "seconds": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, help="an HF model folder (default: a random Qwen2.5-0.5B shape)")
    p.add_argument("--python", default=sys.executable, help="interpreter that has SGLang")
    p.add_argument("--gpus", type=int, nargs=2, default=[0, 1], help="the GPU of each of the two servers")
    p.add_argument("--episodes", type=int, default=128)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--obs-len", type=int, default=48)
    p.add_argument("--vocab", type=int, default=151936, help="prompt ids are drawn below this")
    p.add_argument("--engine-args", type=json.loads, default=None, help="server flags (default: GPU ones)")
    p.add_argument("--startup-timeout", type=float, default=1200)
    args = p.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="agent-affinity-"))
    if args.model_dir is None:
        sys.path.insert(0, str(Path(__file__).parent))
        from rollout_throughput import make_qwen_shaped_model

        args.model_dir = make_qwen_shaped_model(work / "qwen2.5-0.5b-random")
    engine_args = dict(GPU_ENGINE_ARGS if args.engine_args is None else args.engine_args)
    servers = []
    for i, gpu in enumerate(args.gpus):
        if args.engine_args is not None:
            servers.append(start_server(i, str(args.model_dir), log_dir=work, python=args.python,
                                        engine_args=engine_args))
            continue
        # SGLang sizes its KV cache as if it were alone (total x fraction, less what is already used), so a
        # second server on a GPU starts after the first holds its memory and asks for the two shares together.
        earlier = [s for s, g in zip(servers, args.gpus[:i], strict=True) if g == gpu]
        for server in earlier:
            wait_healthy(server, args.startup_timeout)
        own_args = {**engine_args, "mem_fraction_static": engine_args["mem_fraction_static"] * (len(earlier) + 1)}
        servers.append(start_server(i, str(args.model_dir), log_dir=work, python=args.python,
                                    engine_args=own_args, gpu_ids=[gpu]))
    rng = random.Random(0)
    prompts = [[rng.randrange(200, args.vocab) for _ in range(args.prompt_len)] for _ in range(args.episodes)]
    results = {}
    try:
        for server in servers:
            wait_healthy(server, args.startup_timeout)
        for policy, keyed in (("manual", True), ("round_robin", False)):
            for server in servers:  # both policies start from empty caches
                httpx.post(f"{server.url}/flush_cache", timeout=60)
            engine = SGLangEngine.attach([s.url for s in servers], work_dir=work / policy, policy=policy,
                                         health_interval=0)
            try:
                results[policy] = asyncio.run(run_episodes(engine, prompts, args, keyed))
            finally:
                asyncio.run(engine.shutdown())
            print(f"{policy}: {results[policy]}", flush=True)
    finally:
        for server in servers:
            server.process.stop()
    print(f"\n{args.episodes} episodes x {args.turns} turns, prompt {args.prompt_len}, {args.new_tokens} sampled + "
          f"{args.obs_len} observation ids a turn, 2 servers")
    print("| router policy | routing key | prefix-cache hit rate | turns 2+ | seconds |")
    print("|---|---|---|---|---|")
    for policy, keyed in (("manual", True), ("round_robin", False)):
        r = results[policy]
        print(f"| {policy} | {'<session>' if keyed else 'none'} | {r['hit_rate']:.3f} | "
              f"{r['later_turns_hit_rate']:.3f} | {r['seconds']:.1f} |")


if __name__ == "__main__":
    main()
