"""Rollout throughput: slime-rl's path (sglang-router + SGLangEngine) against SGLang alone
(concurrent HTTP straight to the server), on the same server and the same prompts.

    python benchmarks/rollout_throughput.py                      # the H200 run (issue 7)
    python benchmarks/rollout_throughput.py --model-dir DIR      # reuse a model folder

Defaults follow the issue: a random Qwen2.5-0.5B-shaped model (bf16, made on the spot),
128-token prompts, 256 new tokens (ignore_eos), log-probs returned, 256 requests in flight,
CUDA graphs on. Each round sends the same prompts through each path (SGLang alone, plain
HTTP through the router, slime-rl; the prefix cache is flushed before each), rotating which
goes first; the table reports the median.
Target: ratio >= 0.95.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx

from slime_rl.core.contracts import SamplingParams
from slime_rl.rollout_sglang.client import build_payload
from slime_rl.rollout_sglang.engine import SGLangEngine
from slime_rl.rollout_sglang.server import start_server, wait_healthy

GPU_ENGINE_ARGS = {"skip_tokenizer_init": True, "attention_backend": "triton", "sampling_backend": "pytorch",
                   "grammar_backend": "none", "mem_fraction_static": 0.6}


def make_qwen_shaped_model(out: Path) -> Path:
    """Qwen2.5-0.5B's shape (494M parameters) with random bf16 weights, and a small BPE tokenizer
    (the router wants a tokenizer.json; token ids go in and out, so its size does not matter)."""
    import glob
    import os

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))[:50],
              trainers.BpeTrainer(vocab_size=1000, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(out)
    cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                      num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                      rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                      eos_token_id=151643, bos_token_id=151643)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    return out


async def sglang_alone(url: str, prompts: list[list[int]], params: SamplingParams, concurrency: int) -> int:
    """The baseline: the same /generate bodies, straight to the server, ``concurrency`` at a time,
    over aiohttp (as SGLang's own bench_serving does)."""
    semaphore = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency),
                                     timeout=aiohttp.ClientTimeout(total=3600)) as http:
        async def one(i: int, prompt: list[int]) -> int:
            async with semaphore:
                payload = build_payload(prompt, params, f"base-{i}-{time.time_ns()}")
                async with http.post(f"{url}/generate", json=payload) as resp:
                    resp.raise_for_status()
                    body = await resp.json()
                assert len(body["meta_info"]["output_token_logprobs"]) == len(body["output_ids"])
                return len(body["output_ids"])

        return sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


async def slime_rl_path(engine: SGLangEngine, prompts: list[list[int]], params: SamplingParams) -> int:
    """slime-rl's rollout path: SGLangEngine.generate through the router (its client bounds concurrency)."""
    outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    assert all(len(o.log_probs) == len(o.token_ids) for o in outs)
    return sum(len(o.token_ids) for o in outs)


def timed(fn) -> tuple[int, float]:
    start = time.perf_counter()
    tokens = asyncio.run(fn())
    return tokens, time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, help="an HF model folder (default: a random Qwen2.5-0.5B shape)")
    p.add_argument("--python", default=sys.executable, help="interpreter that has SGLang")
    p.add_argument("--requests", type=int, default=1024)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--vocab", type=int, default=151936, help="prompt token ids are drawn below this")
    p.add_argument("--no-cuda-graph", action="store_true", help="disable CUDA graphs (functional runs only)")
    p.add_argument("--engine-args", type=json.loads, default=None,
                   help="JSON dict of SGLang server flags, replacing the GPU defaults")
    p.add_argument("--startup-timeout", type=float, default=1200)
    p.add_argument("--logs-to", type=Path, default=None, help="copy the server and router logs here at the end")
    args = p.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="rollout-throughput-"))
    model_dir = args.model_dir or make_qwen_shaped_model(work / "qwen2.5-0.5b-random")
    engine_args = dict(GPU_ENGINE_ARGS if args.engine_args is None else args.engine_args)
    if args.no_cuda_graph:
        engine_args.update(cuda_graph_backend_decode="disabled", cuda_graph_backend_prefill="disabled")
    print(f"model {model_dir}; server flags {engine_args}; logs under {work}", flush=True)

    server = start_server(0, str(model_dir), log_dir=work, python=args.python, engine_args=engine_args)
    engine = None
    try:
        t0 = time.perf_counter()
        wait_healthy(server, args.startup_timeout)
        print(f"server healthy after {time.perf_counter() - t0:.0f} s", flush=True)
        engine = SGLangEngine.attach([server.url], work_dir=work, max_concurrency=args.concurrency,
                                     health_interval=0)
        rng = random.Random(0)
        params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, ignore_eos=True)

        def prompts() -> list[list[int]]:
            return [[rng.randrange(10, args.vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]

        def flush() -> None:
            httpx.post(f"{server.url}/flush_cache", timeout=60).raise_for_status()

        warm = prompts()[: min(args.requests, args.concurrency)]  # JIT, graphs and pools warm up on both paths
        timed(lambda: sglang_alone(server.url, warm, params, args.concurrency))
        timed(lambda: slime_rl_path(engine, warm, params))

        # "router": the baseline's plain HTTP client through the router, which splits the gap between
        # the router hop and SGLangEngine's own client.
        paths = {"alone": lambda b: sglang_alone(server.url, b, params, args.concurrency),
                 "router": lambda b: sglang_alone(engine.router.url, b, params, args.concurrency),
                 "slime": lambda b: slime_rl_path(engine, b, params)}
        results: dict[str, list[tuple[int, float]]] = {name: [] for name in paths}
        for r in range(args.rounds):
            batch = prompts()
            for which in list(paths)[r % 3:] + list(paths)[:r % 3]:  # each path takes each turn
                flush()
                results[which].append(timed(lambda b=batch, fn=paths[which]: fn(b)))
                tokens, secs = results[which][-1]
                print(f"round {r} {which:>6}: {tokens} tokens in {secs:.2f} s = {tokens / secs:,.0f} tok/s", flush=True)
        print(f"SGLangEngine client retries: {engine.client.retries}")
    finally:
        if engine is not None:
            asyncio.run(engine.shutdown())
        server.process.stop()
        if args.logs_to:  # the server's and the router's logs, for a run on a machine that goes away
            args.logs_to.mkdir(parents=True, exist_ok=True)
            for log in work.rglob("*.log"):
                shutil.copy(log, args.logs_to / log.name)

    def median_rate(rows: list[tuple[int, float]]) -> tuple[int, float, float]:
        secs = statistics.median(s for _, s in rows)
        tokens = rows[0][0]
        return tokens, secs, tokens / secs

    a_tok, a_s, a_rate = median_rate(results["alone"])
    r_tok, r_s, r_rate = median_rate(results["router"])
    s_tok, s_s, s_rate = median_rate(results["slime"])
    print()
    print(f"{args.requests} requests, {args.concurrency} in flight, {args.prompt_len}-token prompts + "
          f"{args.max_new_tokens} new tokens, log-probs on, CUDA graphs {'off' if args.no_cuda_graph else 'on'}; "
          f"median of {args.rounds} rounds")
    print(f"| {'path':<44} | {'new tokens':>10} | {'seconds':>8} | {'tokens/s':>10} |")
    print(f"|{'-' * 46}|{'-' * 12}|{'-' * 10}|{'-' * 12}|")
    print(f"| {'SGLang alone (concurrent HTTP to the server)':<44} | {a_tok:>10} | {a_s:>8.2f} | {a_rate:>10,.0f} |")
    print(f"| {'plain HTTP through sglang-router':<44} | {r_tok:>10} | {r_s:>8.2f} | {r_rate:>10,.0f} |")
    print(f"| {'slime-rl (sglang-router + SGLangEngine)':<44} | {s_tok:>10} | {s_s:>8.2f} | {s_rate:>10,.0f} |")
    print(f"ratio slime-rl / SGLang alone: {s_rate / a_rate:.3f} (target >= 0.95)")


if __name__ == "__main__":
    main()
