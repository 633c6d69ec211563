"""Weight sync at real size: the trainer's weights into a real SGLang engine, every way slime-rl does it.

    python benchmarks/weight_sync.py --shape qwen2.5-7b --bucket-mb 512 2048 4096    # the H200 run (issue 16)
    python benchmarks/weight_sync.py --shape llama-tiny qwen2-tiny qwen3-tiny --syncs 1  # the equality check
    python benchmarks/weight_sync.py --shape tiny --engine-python FAKE_PYTHON --device cpu  # the CPU smoke test
    python benchmarks/weight_sync.py --shape qwen2.5-1.5b --lora-rank 16 --paths trainer adapter  # LoRA (issue 20)

The trainer side is random bf16 weights of the shape, on the GPU, cut into buckets of ``--bucket-mb``
(the sync needs the weights only, so a 7B fits one H200 next to its engine); the engine is started
with SGLang's dummy weights (``--load-format dummy``) for shapes too large to write to disk (unless
``--paths`` has ``disk``). Each path is timed over ``--syncs`` syncs of the whole model:

- ``direct``: each bucket serialised (`weights.ipc.serialize_bucket`) and posted straight to
  ``/update_weights_from_tensor``: what SGLang itself costs;
- ``trainer``: the training loop's path: `SGLangEngine.begin_weight_sync`, trainer rank 0's
  `SGLangWeightSender.send`, `end_weight_sync` (pause, push, flush, continue);
- ``engine``: `SGLangEngine.update_weights`, bucket by bucket, from tensors in the engine's process;
- ``engine-copy``: the same with ``keep_weights_for_recovery=True`` (a pinned host copy of each version);
- ``disk``: the trainer path by ``disk`` (HF shards the engine loads);
- ``adapter`` (with ``--lora-rank``): the trainer path with ``trainer.lora`` (`SGLangWeightSender` loads
  random rank-R adapters on every projection as one SGLang adapter per version, by CUDA IPC), against a
  server started with slime-rl's LoRA flags (`adapters.lora_engine_args`; the full-weight paths run on the
  same server); ``adapter-engine``: the same through `SGLangEngine.update_weights`; ``adapter-disk``: the
  trainer path by ``disk`` (a PEFT folder the servers load). The figure for issue 20 is an adapter row's
  seconds over the full-weight row of the same way in (``trainer``; ``disk`` for ``adapter-disk``;
  target: at most 1/10).

Reported: seconds per sync (median), GB/s over the model's bytes, the peak extra GPU memory in this
process and on the device during a sync, and the engine's checksums of every parameter it holds
under a trainer name (SGLang's ``/weights_checker``) compared with the trainer's after the last sync
(adapter rows: the servers that list the last version's adapter in ``/v1/models``). Per path also
where a sync's time goes (seconds in each step, `PHASES`) and how long the writes it leaves running in
the background take (the restore copy of the weights, adapter folders): the benchmark waits for them
between syncs, untimed, as the loop's train step would.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from slime_rl.core.algorithms.lora import LoraSpec, adapter_name, peft_name
from slime_rl.core.config import Config
from slime_rl.core.contracts import NamedTensors
from slime_rl.rollout_sglang.engine import SGLangEngine
from slime_rl.rollout_sglang.keys import bearer
from slime_rl.rollout_sglang.weights import adapters, ipc, server_api, verify
from slime_rl.rollout_sglang.weights.adapter_roster import AdapterRoster
from slime_rl.rollout_sglang.weights.adapters import SGLANG_LORA_MODULES, lora_engine_args
from slime_rl.rollout_sglang.weights.pusher import BucketPusher
from slime_rl.rollout_sglang.weights.restore_copy import RestoreCopy
from slime_rl.rollout_sglang.weights.trainer_sender import SGLangWeightSender

SHAPES = {
    # name: (family, vocab, hidden, intermediate, layers, heads, kv_heads, tied)
    "qwen2.5-7b": ("qwen2", 152064, 3584, 18944, 28, 28, 4, False),
    "qwen2.5-3b": ("qwen2", 151936, 2048, 11008, 36, 16, 2, True),
    "qwen2.5-1.5b": ("qwen2", 151936, 1536, 8960, 28, 12, 2, True),
    "qwen2.5-0.5b": ("qwen2", 151936, 896, 4864, 24, 14, 2, True),
    "llama-tiny": ("llama", 1024, 256, 688, 2, 4, 2, False),
    "qwen2-tiny": ("qwen2", 1024, 256, 688, 2, 4, 2, False),
    "qwen3-tiny": ("qwen3", 1024, 256, 688, 2, 4, 2, False),
    "tiny": ("qwen2", 1024, 64, 128, 2, 4, 2, False),  # the CPU smoke test
}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
WRITE_WEIGHTS_BELOW = 200_000_000  # parameters; larger shapes start the engine on dummy weights
PATHS = ("direct", "trainer", "engine", "engine-copy", "disk")
ADAPTER_PATHS = ("adapter", "adapter-engine", "adapter-disk")  # with --lora-rank
# The full-weight row each adapter row is compared with: the same way into the engine.
FULL_PATH_OF = {"adapter": "trainer", "adapter-engine": "trainer", "adapter-disk": "disk"}
GPU_ENGINE_ARGS = {"skip_tokenizer_init": True, "attention_backend": "triton", "sampling_backend": "pytorch",
                   "grammar_backend": "none", "cuda_graph_backend_decode": "disabled",
                   "cuda_graph_backend_prefill": "disabled", "dtype": "bfloat16", "max_total_tokens": 65536}


@dataclass
class Row:
    shape: str
    path: str
    bucket_mib: int
    buckets: int
    seconds: list[float]
    gb: float
    peak_extra_process_gib: float
    peak_extra_device_gib: float
    checked: int  # tensors whose checksums matched after the last sync
    phases: dict[str, float] = field(default_factory=dict)  # mean seconds per timed sync in each step (PHASES)
    background_s: float = 0.0  # mean seconds the sync's background writes ran on after it (restore copies)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def make_model_folder(shape: str, folder: Path, *, weights: bool | None = None) -> Path:
    """An HF folder of ``shape``: its config, a small tokenizer and (``weights``; default: when small)
    random bf16 weights, made on the GPU when there is one."""
    from transformers import AutoModelForCausalLM

    from slime_rl.core.testing import stdlib_text, tiny_config, train_tokenizer

    family, vocab, hidden, inter, layers, heads, kv, tied = SHAPES[shape]
    tokenizer = train_tokenizer(stdlib_text(10), vocab_size=512, pad_token="<|endoftext|>")
    config = tiny_config(family, vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
                         num_heads=heads, num_kv_heads=kv, tie_word_embeddings=tied, max_position_embeddings=32768,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config.dtype = torch.bfloat16
    config.architectures = [ARCHITECTURES[family]]  # SGLang picks its model class by this
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(folder)
    if weights is None:
        weights = param_count(config) < WRITE_WEIGHTS_BELOW
    if not weights:
        config.save_pretrained(folder)
        return folder
    torch.manual_seed(1)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    del model
    return folder


def param_count(config) -> int:
    return sum(shape.numel() for _, shape in weight_shapes(config))


def weight_shapes(config) -> list[tuple[str, torch.Size]]:
    """The HF parameter names and shapes of ``config`` (tied weights once), without allocating them."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [(name, p.shape) for name, p in model.named_parameters()]


def trainer_weights(folder: Path, device: str, seed: int = 7) -> NamedTensors:
    """Random bf16 weights of the folder's shape on ``device`` (not the engine's: a sync must change them)."""
    from transformers import AutoConfig

    gen = torch.Generator(device=device).manual_seed(seed)
    return [(name, (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * 0.02).to(torch.bfloat16))
            for name, shape in weight_shapes(AutoConfig.from_pretrained(folder))]


def trainer_adapter(folder: Path, spec: LoraSpec, device: str, seed: int) -> NamedTensors:
    """Random bf16 LoRA A [rank, in] and B [out, rank] under PEFT names for every projection of the
    folder's shape that ``spec`` targets, as the trainer's `named_weights` yields them with LoRA."""
    from transformers import AutoConfig

    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = []
    for name, shape in weight_shapes(AutoConfig.from_pretrained(folder)):
        if any(name.endswith(f".{module}.weight") for module in spec.target_modules):
            for which, dims in (("A", (spec.rank, shape[1])), ("B", (shape[0], spec.rank))):
                tensor = torch.randn(dims, generator=gen, device=device, dtype=torch.float32) * 0.01
                tensors.append((peft_name(name, which), tensor.to(torch.bfloat16)))
    return tensors


def serving_adapter(engine: SGLangEngine, version: int) -> int:
    """How many of the engine's servers list version ``version``'s adapter (``/v1/models``)."""
    import httpx

    count = 0
    for server in engine.servers:
        cards = httpx.get(f"{server.url}/v1/models", headers=bearer(server.keys.api_key), timeout=60).json()["data"]
        count += adapter_name(version) in {card["id"] for card in cards}
    return count


def bucketed(named: NamedTensors, bucket_bytes: int) -> list[NamedTensors]:
    """Consecutive tensors up to ``bucket_bytes`` each (a larger tensor alone), as the trainer cuts them."""
    buckets, current, size = [], [], 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append((name, tensor))
        size += nbytes
    return buckets + ([current] if current else [])


# The steps of a sync, timed where the code calls them (in this process, any thread): where the time goes.
PHASES = {"pause": (server_api, "pause_generation"), "flush": (server_api, "flush_cache"),
          "continue": (server_api, "continue_generation"), "post bucket": (ipc, "update_from_tensor"),
          "push bucket": (BucketPusher, "push"),
          "restore copy": (RestoreCopy, "add"), "restore finish": (RestoreCopy, "finish"),
          "load adapter": (adapters, "load_adapter_from_tensors"), "unload adapter": (adapters, "unload_adapter"),
          "load adapter folder": (adapters, "load_adapter_from_folder"),
          "adapter folder": (adapters.FolderWriter, "write"), "adapter snapshot": (adapters, "_snapshot")}


@contextlib.contextmanager
def phase_clock(seconds: Counter):
    """Adds the seconds spent in each of PHASES' functions to ``seconds`` while it is open (nested calls,
    such as the post inside a push, count in both)."""
    lock, originals = threading.Lock(), {}

    def timed(phase, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                with lock:
                    seconds[phase] += time.perf_counter() - start
        return wrapper

    for phase, (owner, name) in PHASES.items():
        originals[(owner, name)] = getattr(owner, name)
        setattr(owner, name, timed(phase, originals[(owner, name)]))
    try:
        yield seconds
    finally:
        for (owner, name), fn in originals.items():
            setattr(owner, name, fn)


def wait_for_background(sender: SGLangWeightSender, engine: SGLangEngine) -> float:
    """Seconds until the writes a sync leaves running (restore copy, adapter folders) are done: the loop's
    next train step hides them; back-to-back syncs here would otherwise wait for them in the next sync."""
    start = time.perf_counter()
    if sender.restore is not None:
        sender.restore.writes.wait()
    sender.adapter_folders.wait()
    if engine.roster is not None:
        engine.roster.writer.wait()
    return time.perf_counter() - start


class DeviceMemoryWatch:
    """The lowest free device memory while it runs (every process on the GPU counts), polled."""

    def __init__(self, on_cuda: bool):
        self.on_cuda, self.lowest, self._stop = on_cuda, None, threading.Event()

    def __enter__(self) -> DeviceMemoryWatch:
        if self.on_cuda:
            self.start_free = self.lowest = torch.cuda.mem_get_info()[0]
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.wait(0.002):
            self.lowest = min(self.lowest, torch.cuda.mem_get_info()[0])

    def __exit__(self, *exc) -> None:
        if self.on_cuda:
            self._stop.set()
            self._thread.join()

    @property
    def extra_gib(self) -> float:
        return (self.start_free - self.lowest) / 2**30 if self.on_cuda else 0.0


def sync_config(folder: Path, work: Path, transport: str, spec: LoraSpec | None = None) -> Config:
    lora = {"rank": spec.rank, "alpha": spec.alpha, "target_modules": list(spec.target_modules)} if spec else {}
    return Config.model_validate({"model": {"path": str(folder)}, "logging": {"dir": str(work)},
                                  "rollout": {"engine": "sglang", "update_weight_transport": transport},
                                  "trainer": {"lora": lora}})


async def one_sync(path: str, engine: SGLangEngine, buckets: list[NamedTensors], version: int,
                   senders: dict[str, SGLangWeightSender], transport: str) -> None:
    if path == "direct":
        for target in engine.targets():
            for i, bucket in enumerate(buckets):
                ipc.update_from_tensor(target, bucket, version=version if i == len(buckets) - 1 else None,
                                       timeout=engine.sync_timeout, step=f"direct bucket {i}")
    elif path in ("trainer", "disk", "adapter", "adapter-disk"):
        targets = await engine.begin_weight_sync(version, transport=transport)
        senders[path].send(iter(buckets), targets, version=version, transport=transport)
        await engine.end_weight_sync(version)
    else:
        engine.keep_weights_for_recovery = path == "engine-copy"
        for i, bucket in enumerate(buckets):
            await engine.update_weights(bucket, version=version, last=i == len(buckets) - 1)


async def run_shape(args, shape: str, work: Path) -> list[Row]:
    on_cuda = args.device == "cuda"
    # a full sync from disk needs a server that loaded its weights from disk (SGLang refuses one on dummy weights)
    from_disk = "disk" in args.paths
    folder = make_model_folder(shape, work / shape, weights=True if from_disk else None)
    engine_args = dict(GPU_ENGINE_ARGS, mem_fraction_static=args.mem_fraction) if on_cuda else {}
    if on_cuda and not from_disk and param_count_of(folder) >= WRITE_WEIGHTS_BELOW:
        engine_args["load_format"] = "dummy"
    spec = LoraSpec(args.lora_rank, 2.0 * args.lora_rank, 0.0, SGLANG_LORA_MODULES) if args.lora_rank else None
    if spec is not None:  # one server for both: the full-weight paths and the adapter paths
        engine_args.update(lora_engine_args(spec))
    engine = SGLangEngine.launch(str(folder), engine_args=engine_args, python=args.engine_python,
                                 work_dir=work / f"{shape}-engine", startup_timeout=args.startup_timeout,
                                 health_interval=0)
    # The adapter paths swap this roster in (the engine then syncs adapters) and out again.
    roster = AdapterRoster(spec, engine.work_dir) if spec is not None else None
    rows: list[Row] = []
    try:
        weights = trainer_weights(folder, args.device)
        gb = sum(t.numel() * t.element_size() for _, t in weights) / 1e9
        lora = trainer_adapter(folder, spec, args.device, seed=3) if spec is not None else []
        lora_gb = sum(t.numel() * t.element_size() for _, t in lora) / 1e9
        print(f"[{shape}] {len(weights)} tensors, {gb:.2f} GB on {args.device}" +
              (f"; rank-{spec.rank} adapter: {len(lora)} tensors, {lora_gb * 1e3:.1f} MB" if spec else ""), flush=True)
        version = 0
        for bucket_mib in args.bucket_mb:
            for path in args.paths:
                if path in ADAPTER_PATHS and spec is None:
                    raise SystemExit(f"--paths {path}: give --lora-rank")
                adapter_path = path in ADAPTER_PATHS
                buckets = bucketed(lora if adapter_path else weights, bucket_mib * 2**20)
                engine.roster = roster if adapter_path else None
                transport = "disk" if path in ("disk", "adapter-disk") else "tensor"
                senders = {path: SGLangWeightSender(sync_config(folder, work / f"{shape}-{path}", transport,
                                                                spec if adapter_path else None), rank=0)}
                seconds, peak_process, peak_device = [], 0.0, 0.0
                phases, background = Counter(), []
                for i in range(args.syncs + args.warmup):
                    version += 1
                    if on_cuda:
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats()
                    held = torch.cuda.memory_allocated() if on_cuda else 0
                    with DeviceMemoryWatch(on_cuda) as watch, phase_clock(Counter()) as spent:
                        start = time.perf_counter()
                        await one_sync(path, engine, buckets, version, senders, transport)
                        if on_cuda:
                            torch.cuda.synchronize()
                        seconds.append(time.perf_counter() - start)
                    waited = wait_for_background(senders[path], engine)
                    if i >= args.warmup:
                        phases.update(spent)
                        background.append(waited)
                    if on_cuda:
                        peak_process = max(peak_process, (torch.cuda.max_memory_allocated() - held) / 2**30)
                    peak_device = max(peak_device, watch.extra_gib)
                if adapter_path:
                    checked = serving_adapter(engine, version)
                else:
                    checked = sum(verify.check_weights(t, verify.check_sample(weights, tp_size=t.tp_size, every=True),
                                                       timeout=engine.sync_timeout, step=f"{path} check")
                                  for t in engine.targets())
                row = Row(shape, path, bucket_mib, len(buckets), seconds[args.warmup:], lora_gb if adapter_path else gb,
                          peak_process, peak_device, checked, {k: v / args.syncs for k, v in phases.items()},
                          statistics.mean(background) if background else 0.0)
                rows.append(row)
                what = f"servers listing {adapter_name(version)}: {checked}" if adapter_path else \
                    f"checksums equal: {checked} tensors"
                print(f"[{shape}] {path:14s} {bucket_mib:5d} MiB x{len(buckets):3d}: "
                      f"{' '.join(f'{s:.3f}' for s in seconds)} s; {row.gb / row.median:.2f} GB/s; {what}", flush=True)
                print(f"[{shape}] {path:14s} per sync: " +
                      ", ".join(f"{k} {v:.3f}" for k, v in sorted(row.phases.items(), key=lambda kv: -kv[1])) +
                      f"; background writes after it {row.background_s:.3f} s", flush=True)
    finally:
        engine.keep_weights_for_recovery = False
        engine.roster = None
        await engine.shutdown()
    return rows


def param_count_of(folder: Path) -> int:
    from transformers import AutoConfig

    return param_count(AutoConfig.from_pretrained(folder))


def table(rows: list[Row]) -> str:
    lines = ["| shape | path | bucket MiB | buckets | s/sync (median) | GB/s | x direct | peak extra GiB (process / "
             "device) | checksums equal |", "|---|---|---|---|---|---|---|---|---|"]
    direct = {(r.shape, r.bucket_mib): r.median for r in rows if r.path == "direct"}
    for r in rows:
        ratio = f"{r.median / direct[(r.shape, r.bucket_mib)]:.2f}" if (r.shape, r.bucket_mib) in direct else "-"
        lines.append(f"| {r.shape} | {r.path} | {r.bucket_mib} | {r.buckets} | {r.median:.3f} | {r.gb / r.median:.1f} | "
                     f"{ratio} | {r.peak_extra_process_gib:.2f} / {r.peak_extra_device_gib:.2f} | {r.checked} |")
    return "\n".join(lines)


def adapter_ratios(rows: list[Row]) -> list[str]:
    """Issue 20's figure: each adapter row's median over its full-weight row's (`FULL_PATH_OF`; same shape
    and bucket size)."""
    full = {(r.shape, r.path, r.bucket_mib): r.median for r in rows if r.path not in ADAPTER_PATHS}
    lines = []
    for r in rows:
        key = (r.shape, FULL_PATH_OF.get(r.path), r.bucket_mib)
        if key in full:
            lines.append(f"[{r.shape}] {r.path} / {key[1]} (full weights), {r.bucket_mib} MiB buckets: "
                         f"{r.median / full[key]:.3f} ({r.median * 1e3:.1f} ms vs {full[key] * 1e3:.1f} ms)")
    return lines


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", nargs="+", default=["qwen2.5-7b"], choices=sorted(SHAPES))
    parser.add_argument("--bucket-mb", nargs="+", type=int, default=[2048])
    parser.add_argument("--paths", nargs="+", default=list(PATHS[:4]), choices=PATHS + ADAPTER_PATHS)
    parser.add_argument("--lora-rank", type=int, default=0, help="LoRA rank of the adapter paths (0: none)")
    parser.add_argument("--syncs", type=int, default=2, help="timed syncs per path")
    parser.add_argument("--warmup", type=int, default=1, help="untimed syncs before them")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--engine-python", default=None, help="interpreter that runs sglang.launch_server")
    parser.add_argument("--mem-fraction", type=float, default=0.3, help="SGLang --mem-fraction-static")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None, help="write the rows here too")
    args = parser.parse_args(argv)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="weight-sync-bench-"))
    rows: list[Row] = []
    for shape in args.shape:
        rows += asyncio.run(run_shape(args, shape, work))
    print(table(rows), flush=True)
    for line in adapter_ratios(rows):
        print(line, flush=True)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
