"""GPU acceptance across packages (the H200 machine; docs/gpu-results.md has the runs):

(b) log-prob parity between a real SGLang server and the Megatron trainer for the same tokens
    and weights (bf16), and
(f) a colocated GRPO run through `slime-cli train` (engine sglang, trainer megatron) on one GPU
    whose reward rises.

    python -m pytest tests/e2e/test_gpu_e2e.py -m gpu -s
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from cut_runs import run_printing

from slime_rl.core.batch import RolloutBatch
from slime_rl.core.config import load_config
from slime_rl.core.contracts import SamplingParams
from slime_rl.core.sample import Sample

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

# Quick functional runs (shared/gpu/README.md): triton attention, pytorch sampling, no CUDA graphs.
ENGINE_ARGS = {"attention_backend": "triton", "sampling_backend": "pytorch", "grammar_backend": "none",
               "cuda_graph_backend_decode": "disabled", "cuda_graph_backend_prefill": "disabled",
               "mem_fraction_static": 0.15, "max_total_tokens": 65536}


@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory) -> Path:
    from slime_rl.core.testing import tiny_model_folder

    return tiny_model_folder(tmp_path_factory.mktemp("gpu-llama"), "llama", hidden_size=256, num_heads=4,
                             dtype=torch.bfloat16)


def train_through_slime_cli(config: dict, *, tokenizer: Path, work: Path, timeout: int) -> list[dict]:
    """``config`` run by `slime-cli train` in a subprocess (tests/support on its path, ``tokenizer`` for the toy
    reward); the rows of its metrics.jsonl (``config``'s logging.dir must be ``work / "run"``)."""
    (work / "config.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "TOY_TOKENIZER": str(tokenizer),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "support"), os.environ.get("PYTHONPATH", "")])}
    metrics = work / "run" / "metrics.jsonl"
    try:
        done = run_printing([sys.executable, "-m", "slime_rl.cli.app", "train", str(work / "config.yaml")],
                            env=env, timeout=timeout)
    except subprocess.TimeoutExpired:  # the steps it finished say how far it got, and at what pace
        rows = metrics.read_text().splitlines() if metrics.is_file() else []
        print(f"[run cut at {timeout} s] {len(rows)} rows of metrics; the last:", *rows[-3:], sep="\n")
        raise
    print(done.stdout[-4000:], done.stderr[-4000:])
    assert done.returncode == 0
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def test_b_logprob_parity_sglang_vs_megatron(gpu_model, tmp_path, monkeypatch):
    from slime_rl.rollout_sglang.engine import SGLangEngine
    from slime_rl.trainer_megatron.trainer import MegatronTrainer

    cfg = load_config(None, [f"model.path={gpu_model}", "model.dtype=bfloat16", "rollout.engine=sglang",
                             f"rollout.sglang.server_args={json.dumps(ENGINE_ARGS)}", "cluster.device=cuda",
                             f"logging.dir={tmp_path}", "data.source=none"], check=False)
    engine = SGLangEngine.from_config(cfg)
    try:
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 1000, (32,), generator=gen).tolist() for _ in range(16)]
        params = SamplingParams(temperature=1.0, max_new_tokens=64, ignore_eos=True)

        async def run_all():
            return await asyncio.gather(*(engine.generate(p, params) for p in prompts))

        outs = asyncio.run(run_all())
    finally:
        asyncio.run(engine.shutdown())
    samples = []
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        s = Sample(index=i, tokens=list(prompt), reward=0.0)
        s.append_response(out.token_ids, out.log_probs, trained=True)
        samples.append(s)
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533", "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    trainer = MegatronTrainer.from_config(cfg)
    batch = RolloutBatch.from_samples(samples)
    diffs = (batch.rollout_log_probs - trainer.compute_log_probs(batch)).abs()
    print(f"\n[parity] SGLang vs Megatron bf16 log-probs over {diffs.numel()} tokens: "
          f"mean abs diff {diffs.mean():.5f}, max abs diff {diffs.max():.5f}")
    assert diffs.numel() == 16 * 64
    assert diffs.mean() < 0.02  # bf16 kernels differ; slime's CI bound on this gap is 0.1


@pytest.mark.parametrize("offload", [True, False], ids=["offload", "no-offload"])
def test_f_colocated_grpo_through_slime_cli(offload, gpu_model, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    lines = ["def main(", "import os\n", "class Foo:", "for i in range(", "return self.", "x = [", "print("]
    prompts.write_text("".join(json.dumps({"input": p, "label": ""}) + "\n" for p in lines * 40))
    config = {
        "model": {"path": str(gpu_model)},
        "data": {"prompt_data": str(prompts), "rollout_batch_size": 16, "n_samples_per_prompt": 8,
                 "num_rollout": 20},
        "rollout": {"engine": "sglang", "sglang": {"server_args": ENGINE_ARGS, "check_weight_update": True},
                    "max_response_len": 16, "reward": "toy_rewards:digit_token_fraction"},
        "trainer": {"backend": "megatron", "lr": 1e-2},
        "cluster": {"device": "cuda", "colocate": True, "actor_num_gpus_per_node": 1, "offload": offload},
        "logging": {"dir": str(tmp_path / "run"), "tensorboard": False, "progress_bar": False},
    }
    rows = train_through_slime_cli(config, tokenizer=gpu_model, work=tmp_path, timeout=900)
    rewards = [r["rollout/reward_mean"] for r in rows]
    print("[grpo] reward per step:", " ".join(f"{r:.3f}" for r in rewards))
    print("[grpo] grad norm per step:", " ".join(f"{r.get('train/grad_norm', float('nan')):.3g}" for r in rows))
    print("[grpo] loss per step:", " ".join(f"{r.get('train/loss', float('nan')):.3g}" for r in rows))
    print("[grpo] step time split:", {k: round(v, 3) for k, v in rows[-1].items() if k.startswith("time/")})
    assert len(rewards) == 20
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.2


@pytest.mark.parametrize("shape", ["tiny", "qwen2.5-1.5b"])
def test_g_lora_grpo_through_sglang_adapters(shape, gpu_model, tmp_path):
    """Issue 20: a colocated GRPO run with trainer.lora whose weight syncs load adapters into SGLang
    (rollout.lora_sync=adapter): the toy reward rises, and SGLang's log-probs with the adapter match the
    trainer's (``train/train_rollout_logprob_abs_diff``, mean abs gap <= 0.02 in bf16) at every step.
    ``qwen2.5-1.5b``: a random Qwen2 of that shape but the tiny model's 1,024-id vocabulary (the toy reward
    reads tokens through it)."""
    model = gpu_model
    if shape != "tiny":
        from slime_rl.core.testing import tiny_model_folder

        model = tiny_model_folder(tmp_path / shape, "qwen2", hidden_size=1536, intermediate_size=8960, num_layers=28,
                                  num_heads=12, num_kv_heads=2, tie_word_embeddings=True, dtype=torch.bfloat16)
    prompts = tmp_path / "prompts.jsonl"
    lines = ["def main(", "import os\n", "class Foo:", "for i in range(", "return self.", "x = [", "print("]
    prompts.write_text("".join(json.dumps({"input": p, "label": ""}) + "\n" for p in lines * 40))
    config = {
        "model": {"path": str(model)},
        "data": {"prompt_data": str(prompts), "rollout_batch_size": 16, "n_samples_per_prompt": 8,
                 "num_rollout": 20},
        "rollout": {"engine": "sglang", "sglang": {"server_args": ENGINE_ARGS}, "max_response_len": 16,
                    "reward": "toy_rewards:digit_token_fraction", "lora_sync": "adapter"},
        "trainer": {"backend": "megatron", "lr": 2e-2 if shape == "tiny" else 2e-3,
                    "lora": {"rank": 16, "alpha": 32}},
        "cluster": {"device": "cuda", "colocate": True, "actor_num_gpus_per_node": 1},
        "logging": {"dir": str(tmp_path / "run"), "tensorboard": False, "progress_bar": False},
    }
    rows = train_through_slime_cli(config, tokenizer=model, work=tmp_path, timeout=1500)
    rewards = [r["rollout/reward_mean"] for r in rows]
    gaps = [r["train/train_rollout_logprob_abs_diff"] for r in rows]
    print(f"[lora-grpo {shape}] reward per step:", " ".join(f"{r:.3f}" for r in rewards))
    print(f"[lora-grpo {shape}] |SGLang (adapter) - Megatron| log-prob per step:", " ".join(f"{g:.4f}" for g in gaps))
    print(f"[lora-grpo {shape}] weight sync s per step:", " ".join(f"{r.get('time/weight_sync', float('nan')):.3f}"
                                                              for r in rows))
    logs = "\n".join(p.read_text() for p in (tmp_path / "run" / "sglang" / "logs").glob("sglang-engine-*.log"))
    assert "slime-v20" in logs or "slime-v19" in logs, "the servers never loaded the late adapters"
    assert len(rewards) == 20
    assert max(gaps) <= 0.02
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1


def test_h_long_responses_through_slime_cli(tmp_path):
    """Issue 36, the loop at long lengths: SGLang generates 8k-token responses (rollout.ignore_eos, so every one
    runs to max_response_len), the Megatron trainer packs them one to a micro-batch with full recompute and trains,
    colocated, through `slime-cli train`; per step the rollout's and the trainer's tokens/s and the trainer's peak
    memory. The 1.5B shape at 32k and 64k tokens is benchmarks/long_sample_train.py (stage long-train)."""
    from slime_rl.core.testing import tiny_model_folder

    response_len, prompt_len = 8192, 64
    model = tiny_model_folder(tmp_path / "model", "llama", hidden_size=256, num_heads=4,
                              max_position_embeddings=prompt_len + response_len, dtype=torch.bfloat16)
    prompts = tmp_path / "prompts.jsonl"
    lines = ["def main(", "import os\n", "class Foo:", "for i in range("]
    prompts.write_text("".join(json.dumps({"input": p, "label": ""}) + "\n" for p in lines * 10))
    # decode CUDA graphs on (up to 16 requests): 8k decode steps a rollout are launch-bound without them
    engine_args = {k: v for k, v in ENGINE_ARGS.items() if k != "cuda_graph_backend_decode"}
    engine_args.update(cuda_graph_max_bs_decode=16, max_total_tokens=16 * (prompt_len + response_len) + 4096)
    steps = 3
    config = {
        "model": {"path": str(model)},
        "data": {"prompt_data": str(prompts), "rollout_batch_size": 4, "n_samples_per_prompt": 4,
                 "num_rollout": steps},
        "rollout": {"engine": "sglang", "sglang": {"server_args": engine_args}, "max_prompt_len": prompt_len,
                    "max_response_len": response_len, "ignore_eos": True,
                    "reward": "toy_rewards:digit_token_fraction"},
        "trainer": {"backend": "megatron", "lr": 1e-4, "max_tokens_per_gpu": prompt_len + response_len,
                    "megatron": {"recompute": True}},
        "cluster": {"device": "cuda", "colocate": True, "actor_num_gpus_per_node": 1},
        "logging": {"dir": str(tmp_path / "run"), "tensorboard": False, "progress_bar": False},
    }
    rows = train_through_slime_cli(config, tokenizer=model, work=tmp_path, timeout=540)
    for i, r in enumerate(rows, 1):
        print(f"[long] step {i}: response_len mean {r['rollout/response_len_mean']:.0f} max"
              f" {r['rollout/response_len_max']:.0f}; rollout {r['rollout/tokens_per_s']:.0f} tok/s;"
              f" trainer peak {r.get('train/peak_memory_gib_max', float('nan')):.2f} GiB;"
              f" grad norm {r.get('train/grad_norm', float('nan')):.3g};",
              {k: round(v, 2) for k, v in r.items() if k.startswith("time/")})
    assert len(rows) == steps
    assert all(r["rollout/response_len_mean"] == response_len == r["rollout/response_len_max"] for r in rows)
    assert all(r["rollout/truncated_frac"] == 1.0 for r in rows)
    assert all(r["train/peak_memory_gib_max"] > 0 and r["train/grad_norm"] > 0 for r in rows)
