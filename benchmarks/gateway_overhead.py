"""The agent gateway's cost: examples/react_agent's agent (unmodified) runs episodes through the gateway in front of
an engine, and every call's latency as the agent sees it is set against the engine's own time for that call.

    python benchmarks/gateway_overhead.py                     # CPU: a tiny random Qwen2 on the transformers engine
    python benchmarks/gateway_overhead.py --engine sglang     # GPU: one SGLang server (router policy manual)

Per call: ``added`` = the agent's wall time for ``chat.completions.create`` (HTTP, the gateway's parsing, history
match, tokenisation, tool-call parsing, the response, the openai client's own work) less the engine's
``generate`` time inside it: what the gateway adds against calling the engine directly. Printed: its median and
p99, and the median of the gateway's own work per call (its checks, history match, tokenising, tool-call parsing
and response, timed on the server; HTTP parsing left out), its mean, and its mean CPU time on the gateway's thread
(``time.thread_time``: the wall-clock figure less the time the thread waited for a core or the GIL); that own work
summed over all calls as a share of the rollout's wall time, by the clock and by CPU time (one event loop serves
the gateway: the share of it the gateway took); and the prefix-cache
hit rate the engine reports (SGLang's ``cached_tokens``; the transformers engine reports none); and the collector's
pauses over the run (``gc.callbacks``: how many, their total as a share of the wall).

``--profile`` also prints where the gateway's own work goes: cProfile switched on only inside its synchronous
parts (the prompt's ids, the reply's text, the request's parsing) in an extra pass of an eighth of the episodes
after the measured runs (profiling the measured run doubled its figures on 2026-12-05), the top functions by their
own time, and what one ``time.thread_time()`` costs on this host (the bench reads it four times a call).

``--gc both`` (the default) runs the episodes twice in one process: first with Python's collector as it comes
(threshold 700, nothing frozen), then with the gateway's tuning (``rollout.gateway.gc_freeze`` and
``gc_threshold``, docs/config.md): the collector's pauses land inside the gateway's calls.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GPU_ENGINE_ARGS = {"attention_backend": "triton", "sampling_backend": "pytorch", "grammar_backend": "none",
                   "mem_fraction_static": 0.35, "skip_tokenizer_init": True}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class GatewayProfile:
    """cProfile on only while the gateway's synchronous parts run (``Gateway._text``, ``parse_messages``,
    ``ChatPrompts.chat_prompt``): a profile of the whole loop would fold in the agent and the engine client."""

    def __init__(self):
        import cProfile

        from slime_rl.core.gateway import recording, server

        self.profile, self._undo = cProfile.Profile(), []
        for owner, name in ((server.Gateway, "_text"), (server, "parse_messages"),
                            (recording.ChatPrompts, "chat_prompt")):
            self._wrap(owner, name)

    def __enter__(self) -> GatewayProfile:
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in self._undo:
            setattr(owner, name, original)
        self._undo = []

    def _wrap(self, owner, name: str) -> None:
        original = getattr(owner, name)

        def profiled(*a, **k):
            self.profile.enable()
            try:
                return original(*a, **k)
            finally:
                self.profile.disable()

        setattr(owner, name, profiled)
        self._undo.append((owner, name, original))

    def report(self, top: int = 20) -> None:
        import io
        import pstats

        text = io.StringIO()
        pstats.Stats(self.profile, stream=text).sort_stats("tottime").print_stats(top)
        print(text.getvalue()[text.getvalue().index("ncalls") - 3:])
        start, n = time.perf_counter(), 20_000
        for _ in range(n):
            time.thread_time()
        print(f"one time.thread_time(): {1e9 * (time.perf_counter() - start) / n:.0f} ns")


async def run(engine, tokenizer, args: argparse.Namespace, settings=None) -> dict[str, float]:
    from slime_rl.core.gateway import Gateway
    from slime_rl.core.gateway.own_time import GC_PAUSES

    gateway = Gateway(engine, tokenizer, settings)
    await gateway.start()  # the collector's tuning happens here, once: its one full collection is not counted
    count, paused = GC_PAUSES.count, GC_PAUSES.total_s  # the gateway's clock of the collector's pauses
    figures = await _episodes(gateway, args)
    return {**figures, "gc_pauses": GC_PAUSES.count - count,
            "gc_share": (GC_PAUSES.total_s - paused) / figures["wall_s"]}


async def _episodes(gateway, args: argparse.Namespace) -> dict[str, float]:
    import openai.resources.chat.completions as chat
    from react_agent import run as react_run

    from slime_rl.core.contracts import SamplingParams
    from slime_rl.core.sample import Sample

    seen: list[tuple[str, float]] = []  # (response id, the agent's wall time for the call)
    create = chat.AsyncCompletions.create

    async def timed_create(self, *a, **k):  # the agent's own call, timed around the library's method
        start = time.perf_counter()
        out = await create(self, *a, **k)
        seen.append((out.id, time.perf_counter() - start))
        return out

    chat.AsyncCompletions.create = timed_create
    params = SamplingParams(temperature=1.0, max_new_tokens=args.max_response_len)
    episodes = []
    slots = asyncio.Semaphore(args.concurrency)

    async def one(k: int) -> None:
        async with slots:
            episode = gateway.open_episode(params)
            episodes.append(episode)
            a, b, c, d = (11 + (k * 7 + j * 13) % 89 for j in range(4))
            sample = Sample(index=k, prompt=f"What is {a} * {b} + {c} * {d}?", label=str(a * b + c * d))
            await react_run(gateway.base_url(episode), episode.key, sample)
            gateway.close_episode(episode)

    start = time.perf_counter()
    try:
        await asyncio.gather(*(one(k) for k in range(args.episodes)))
    finally:
        chat.AsyncCompletions.create = create
    wall = time.perf_counter() - start
    await gateway.stop()
    calls = {f"chatcmpl-{e.id}-{c.index}": c for e in episodes for c in e.calls if c.token_ids}
    added = [latency - calls[rid].engine_s for rid, latency in seen if rid in calls]  # calls the engine served
    own, own_cpu = sum(c.own_s for c in calls.values()), sum(c.own_cpu_s for c in calls.values())
    own_gc = sum(c.own_gc_s for c in calls.values())
    reported = [c for c in calls.values() if c.cached_tokens is not None]
    hit = (sum(c.cached_tokens for c in reported) / sum(len(c.prompt_ids) for c in reported)) if reported else None
    return {"episodes": len(episodes), "calls": len(calls), "wall_s": wall,
            "added_median_ms": 1e3 * statistics.median(added), "added_p99_ms": 1e3 * percentile(added, 0.99),
            "engine_median_ms": 1e3 * statistics.median(c.engine_s for c in calls.values()),
            "own_median_ms": 1e3 * statistics.median(c.own_s for c in calls.values()),
            "own_mean_ms": 1e3 * own / len(calls), "own_cpu_mean_ms": 1e3 * own_cpu / len(calls),
            "own_gc_mean_ms": 1e3 * own_gc / len(calls),
            "gateway_share": own / wall, "gateway_cpu_share": own_cpu / wall, "prefix_cache_hit_rate": hit}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=["hf", "sglang"], default="hf")
    p.add_argument("--model-dir", type=Path, help="an HF folder with a chat template (default: a tiny random Qwen2 "
                                                  "with core.testing's chat tokenizer)")
    p.add_argument("--episodes", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-response-len", type=int, default=4096, help="per episode: large, so every call samples")
    p.add_argument("--python", default=sys.executable, help="interpreter that has SGLang")
    p.add_argument("--profile", action="store_true", help="also print the top functions of the gateway's own work")
    p.add_argument("--gc", choices=["both", "python", "tuned"], default="both",
                   help="the collector as Python sets it, the gateway's tuning (its default), or both in turn")
    p.add_argument("--json", type=Path, help="also write the figures here: the tuned run's (or the only one's), "
                                             "with the other under 'python_gc'")
    args = p.parse_args(argv)
    sys.path.insert(0, str(REPO / "examples" / "react_agent"))
    import os

    os.environ.setdefault("REACT_AGENT_MODEL", "policy")
    from transformers import AutoTokenizer

    from slime_rl.core.testing import chat_tokenizer, tiny_model_folder

    work = Path(tempfile.mkdtemp(prefix="gateway-overhead-"))
    model_dir = args.model_dir or tiny_model_folder(work / "model", "qwen2", tokenizer=chat_tokenizer())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    server = None
    if args.engine == "hf":
        from slime_rl.rollout_hf.engine import HFEngine

        engine = HFEngine.from_pretrained(model_dir, max_batch_size=args.concurrency)
    else:
        from slime_rl.rollout_sglang.engine import SGLangEngine
        from slime_rl.rollout_sglang.server import start_server, wait_healthy

        server = start_server(0, str(model_dir), log_dir=work, python=args.python, engine_args=GPU_ENGINE_ARGS)
        wait_healthy(server, 1200)
        engine = SGLangEngine.attach([server.url], work_dir=work / "engine", policy="manual", health_interval=0)
    from slime_rl.core.gateway import GatewaySettings

    modes = {"python": GatewaySettings(gc_freeze=False, gc_threshold=None), "tuned": GatewaySettings()}
    runs: dict[str, dict] = {}
    profile = None
    order = ["python", "tuned"] if args.gc == "both" else [args.gc]
    profile_args = argparse.Namespace(**{**vars(args), "episodes": max(1, args.episodes // 8)})
    try:
        for mode in order:
            runs[mode] = asyncio.run(run(engine, tokenizer, args, modes[mode]))
        if args.profile:  # a pass of its own, an eighth as long: cProfile's cost stays out of the figures
            with GatewayProfile() as profile:
                asyncio.run(run(engine, tokenizer, profile_args, modes[order[-1]]))
    finally:
        asyncio.run(engine.shutdown())
        if server is not None:
            server.process.stop()
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    first = next(iter(runs.values()))
    print(f"\n{args.engine} engine, {first['episodes']} ReAct episodes ({first['calls']} calls) a run, "
          f"{args.concurrency} at once; {cpu}")
    print("| engine | collector | added per call, median | p99 | of it in the gateway, median | mean | mean CPU | "
          "collector inside it, mean | engine per call, median | gateway share of wall | its CPU share | GC pauses | "
          "their share of wall | prefix-cache hit rate |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for mode, f in runs.items():
        hit = f["prefix_cache_hit_rate"]
        print(f"| {args.engine} | {'Python default' if mode == 'python' else 'gateway tuning'} | "
              f"{f['added_median_ms']:.1f} ms | {f['added_p99_ms']:.1f} ms | {f['own_median_ms']:.2f} ms | "
              f"{f['own_mean_ms']:.2f} ms | {f['own_cpu_mean_ms']:.2f} ms | {f['own_gc_mean_ms']:.3f} ms | "
              f"{f['engine_median_ms']:.1f} ms | "
              f"{100 * f['gateway_share']:.1f}% | {100 * f['gateway_cpu_share']:.1f}% | {f['gc_pauses']} | "
              f"{100 * f['gc_share']:.1f}% | {'not reported' if hit is None else f'{hit:.3f}'} |")
    if profile is not None:
        print(f"\nThe gateway's synchronous work in a pass of its own ({profile_args.episodes} episodes, the "
              f"{order[-1]} collector), by own time (cProfile only inside it):")
        profile.report()
    if args.json:
        figures = dict(runs.get("tuned") or runs["python"])
        if "tuned" in runs and "python" in runs:
            figures["python_gc"] = runs["python"]
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
