"""Shared pieces of the trainer-megatron tests: tiny random HF models, samples, configs,
the single-rank process group, and a launcher for multi-rank runs (one process per rank)."""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from slime_rl.core.infra.net import free_port
from slime_rl.core.testing import save_model, tiny_config, tiny_model

HERE = Path(__file__).resolve().parent
WORKER = HERE / "megatron_worker.py"


def ensure_single_rank_group() -> None:
    """This (pytest) process as a world of one, so TP=1 runs need no subprocess."""
    if torch.distributed.is_initialized():
        return
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")


def make_hf_model(path: Path, family: str = "llama", *, tie: bool = False, seed: int = 0, vocab: int = 256,
                  layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, intermediate: int = 128,
                  rope_scaling: dict | None = None, dtype: torch.dtype = torch.float32, **fields) -> Path:
    """A random HF model folder (config.json + model.safetensors, no tokenizer); norms and biases perturbed
    so that every parameter matters. ``fields``: other config fields (tiny_config's)."""
    extra = {"head_dim": hidden // heads * 2} if family == "qwen3" else {}  # head_dim != hidden/heads
    extra.update(fields)
    config = tiny_config(family, vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, tie_word_embeddings=tie,
                         max_position_embeddings=512, **extra)
    if rope_scaling is not None:
        config.rope_parameters = {**config.rope_parameters, **rope_scaling}
    return save_model(path, tiny_model(config, seed=seed, perturb_norms=True), dtype=dtype)


def load_hf(path: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def hf_response_log_probs(hf_model, tokens: list[int], response_length: int, temperature: float = 1.0) -> torch.Tensor:
    device = next(hf_model.parameters()).device
    ids = torch.tensor([tokens], device=device)
    with torch.no_grad():
        logits = hf_model(ids).logits[0].float() / temperature
    logp = torch.log_softmax(logits, -1)[:-1].gather(1, ids[0, 1:, None]).squeeze(1)
    return logp[-response_length:]


def make_samples(n: int, vocab: int, *, seed: int = 1, prompt: tuple[int, int] = (3, 9),
                 response: tuple[int, int] = (2, 12)) -> list:
    """Random prompts and responses with GRPO-like advantages and a few masked tokens (the reward is
    the advantage; the engine's log-probs a constant: neither drives the trainer unless a test says so)."""
    from slime_rl.core.sample import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = int(torch.randint(prompt[0], prompt[1] + 1, (1,), generator=g))
        r = int(torch.randint(response[0], response[1] + 1, (1,), generator=g))
        tokens = torch.randint(0, vocab, (p + r,), generator=g).tolist()
        mask = [1] * r
        if r > 3:
            mask[1] = 0  # a tool-output token: not trained on
        adv = float(torch.randn((), generator=g))
        out.append(Sample(index=i, group_index=i // 4, tokens=tokens, response_length=r, loss_mask=mask,
                          rollout_log_probs=[-1.0] * r, reward=adv, advantages=[adv] * r))
    return out


#: Sample fields that become the batch's trainer columns in `to_batch`.
TRAINER_FIELDS = ("old_log_probs", "ref_log_probs", "advantages", "returns", "values")


def to_batch(samples: list, *, dp_size: int = 1, dp_rank: int = 0, samples_per_step: int | None = None):
    """The trainer's input for ``samples``: `RolloutBatch.from_samples`, with each per-token field of
    TRAINER_FIELDS that every sample carries as a column, cut into optimizer steps of
    ``samples_per_step`` (default: one step) and sharded as the loop shards it; rank ``dp_rank``'s shard."""
    from slime_rl.core.batch import RolloutBatch

    batch = RolloutBatch.from_samples(samples)
    for name in TRAINER_FIELDS:
        rows = [getattr(s, name) for s in samples]
        if samples and all(rows):
            setattr(batch, name, torch.tensor([x for row in rows for x in row], dtype=torch.float32))
    return batch.shard(dp_size, samples_per_step or len(samples))[dp_rank]


def per_sample(batch, per_token: torch.Tensor) -> list[list[float]]:
    """A ``[num_response_tokens]`` result split into one list per sample of ``batch``."""
    return [part.tolist() for part in per_token.split(batch.response_lengths.tolist())]


def make_config(model_path: Path, overrides: list[str] | None = None):
    from slime_rl.core.config import load_config

    base = [f"model.path={model_path}", "cluster.device=cpu", "trainer.lr=0.001", "trainer.micro_batch_size=2"]
    return load_config(None, base + list(overrides or []), check=False)


def trainer_for(model_dir: Path, overrides=(), role: str = "actor"):
    """A MegatronTrainer of ``model_dir`` with config ``overrides`` in this process, as a world of one."""
    from slime_rl.trainer_megatron.trainer import MegatronTrainer

    ensure_single_rank_group()
    return MegatronTrainer.from_config(make_config(model_dir, list(overrides)), role=role)


def sample_log_probs(trainer, samples: list) -> list[list[float]]:
    """The trainer's log-probs of ``samples``' response tokens, one list per sample."""
    batch = to_batch(samples)
    return per_sample(batch, trainer.compute_log_probs(batch))


def max_gap_to_hf(samples: list, ours: list[list[float]], hf_model, temperature: float = 1.0) -> float:
    """The largest difference between ``ours`` (per-sample log-probs) and transformers' over every response token."""
    return max(float((torch.tensor(lp) - hf_response_log_probs(hf_model, s.tokens, s.response_length, temperature))
                     .abs().max()) for s, lp in zip(samples, ours, strict=True))


def wide_model(path: Path, family: str, *, vocab: int = 256, **fields) -> Path:
    """A tiny random ``family`` folder (norms perturbed), its weights drawn wider than transformers' 0.02 so that
    routing and attention are far from uniform and every query and key part shows in the outputs."""
    config = tiny_config(family, vocab_size=vocab, max_position_embeddings=512, **{"initializer_range": 0.1, **fields})
    return save_model(path, tiny_model(config, perturb_norms=True))


def megatron_on_cpu_single_rank() -> None:
    """Megatron's parallel state (TP = PP = 1) on the CPU in this process, for tests that call its pieces directly."""
    from megatron.core import parallel_state

    from slime_rl.trainer_megatron import device

    ensure_single_rank_group()
    device.redirect_megatron_to_cpu()
    device.init_distributed("cpu")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


# What a rank imports before it does anything (~4-7 s of CPU each, once per process): on the CPU a forkserver
# imports it once per pytest process and forks every rank from there, where each rank was a fresh interpreter.
_RANK_IMPORTS = ["torch", "transformers", "megatron.core", "slime_rl.trainer_megatron.trainer", "megatron_worker"]


@functools.cache
def _rank_context() -> multiprocessing.context.BaseContext | None:
    """The forkserver the ranks fork from; None on a CUDA machine, where a fork after CUDA was touched (an
    import may ask for the device count) breaks the child: there each rank is a fresh interpreter."""
    if torch.cuda.is_available():
        return None
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_RANK_IMPORTS)
    return context


def _forked_rank(spec_file: str, env: dict[str, str], log_file: str) -> None:
    """One rank in a process forked from the preloaded forkserver: its environment, its output to its log."""
    import warnings

    log = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.clear()  # the launching test's environment, not the one the forkserver started with
    os.environ.update(env)
    warnings.simplefilter("ignore")  # PYTHONWARNINGS=ignore, read only at an interpreter's start
    torch.set_num_threads(1)
    import megatron_worker

    megatron_worker.main(spec_file)


def launch(world_size: int, spec: dict, tmp_path: Path, timeout: float = 300.0) -> dict:
    """Run megatron_worker.py on ``world_size`` ranks (one process each); rank 0's result."""
    spec_file = tmp_path / f"spec-{os.getpid()}-{free_port()}.json"
    out_file = spec_file.with_suffix(".pt")
    spec = {**spec, "out": str(out_file)}
    spec_file.write_text(json.dumps(spec))
    port = free_port()
    envs = [{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world_size),
             "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
            for rank in range(world_size)]
    context = _rank_context()
    if context is None:
        results = _launch_interpreters(spec_file, envs, timeout)
    else:
        results = _launch_forked(context, spec_file, envs, timeout)
    if any(code != 0 for code, _ in results):
        raise AssertionError("multi-rank run failed:\n" + "\n".join(
            f"--- rank {rank} (exit {code}) ---\n{out[-6000:]}" for rank, (code, out) in enumerate(results)))
    return torch.load(out_file, weights_only=True)


def _launch_interpreters(spec_file: Path, envs: list[dict[str, str]], timeout: float) -> list[tuple[int, str]]:
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(spec_file)], env={**os.environ, **env},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for env in envs]
    results = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            out, _ = proc.communicate()
            out += f"\n(killed after {timeout:.0f} s)"
        results.append((proc.returncode, out))
    return results


def _launch_forked(context, spec_file: Path, envs: list[dict[str, str]], timeout: float) -> list[tuple[int, str]]:
    logs = [spec_file.with_suffix(f".rank{rank}.log") for rank in range(len(envs))]
    procs = [context.Process(target=_forked_rank, args=(str(spec_file), {**os.environ, **env}, str(log)))
             for env, log in zip(envs, logs, strict=True)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    timed_out = False
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            timed_out = True
            for p in procs:
                p.kill()
            proc.join()
    note = f"\n(killed after {timeout:.0f} s)" if timed_out else ""
    return [(proc.exitcode, (log.read_text(errors="replace") if log.exists() else "") + note)
            for proc, log in zip(procs, logs, strict=True)]


def assert_replayed_like_one_rank(single: dict, multi: dict) -> None:
    """Routing replay on several ranks against one rank (run_scenario's results): every micro-batch replayed the
    given experts, and the log-probs, losses and grad norms agree within 1e-5."""
    for a, b in zip(single["log_probs"], multi["log_probs"], strict=True):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    for one, two in zip(single["metrics"], multi["metrics"], strict=True):
        assert one["moe_routing_replayed"] == two["moe_routing_replayed"] == 1.0
        assert abs(one["loss"] - two["loss"]) <= 1e-5 and abs(one["grad_norm"] - two["grad_norm"]) <= 1e-5
