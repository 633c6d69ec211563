"""The loop's data path with two data-parallel ranks and no model (slime_rl.core.testing.standins): the
rollout worker puts one shard per rank into the object store, each rank trains on its own half of
the step, and what went through the object store is the batch's tensors, not a copy per rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slime_rl.core.config import load_config
from slime_rl.core.run import loop
from slime_rl.core.run.loop import train

pytestmark = pytest.mark.slow


def standin_config(model_dir, tmp_path, monkeypatch, *, prompts: int, overrides: list[str]):
    """Two steps of stand-in backends on ``prompts`` one-line prompts (toy_rewards scores them)."""
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[1] / "support"))  # Ray workers import toy_rewards
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"input": f"q {i}", "label": "1"}) + "\n" for i in range(prompts)))
    return load_config(None, [
        f"model.path={model_dir}", f"data.prompt_data={data}", "data.num_rollout=2", "model.dtype=float32",
        "rollout.reward=toy_rewards:odd_index", "rollout.reward_workers=0", "cluster.device=cpu",
        f"logging.dir={tmp_path / 'logs'}", f"checkpoint.save_dir={tmp_path / 'ckpt'}", "logging.tensorboard=false",
        *overrides,
    ])


def test_each_rank_trains_on_its_own_shard(tiny_model_dir, tmp_path, monkeypatch):
    cfg = standin_config(tiny_model_dir, tmp_path, monkeypatch, prompts=16, overrides=[
        "data.rollout_batch_size=4", "data.n_samples_per_prompt=4", "rollout.max_response_len=2000",
        "rollout.engine=slime_rl.core.testing.standins:InstantEngine", "trainer.backend=slime_rl.core.testing.standins:NoMathTrainer",
        "trainer.num_steps_per_rollout=2", "cluster.actor_num_gpus_per_node=2", "cluster.num_gpus_per_node=2",
    ])
    steps = []
    summary = train(cfg, callback=lambda event, payload: steps.append(payload["metrics"]) if event == "step" else None)
    assert summary["steps"] == 2 and len(steps) == 2
    for metrics in steps:
        halves = [metrics["train/shard_bytes/0"], metrics["train/shard_bytes/1"]]
        # 16 samples of equal length: each rank gets 8, the same bytes, and together the whole batch
        assert halves[0] == halves[1] > 0
        assert sum(halves) == metrics["perf/batch_tensor_bytes"]
        # pickling adds a few KB per shard: next to 2k-token responses, well under 1.2x
        assert metrics["perf/batch_tensor_bytes"] <= metrics["perf/batch_object_bytes"] <= (
            1.2 * metrics["perf/batch_tensor_bytes"])
        assert metrics["train/optimizer_steps"] == 2.0  # each shard carries both optimizer steps' halves
        assert metrics["rollout/weight_version_lag"] == 0.0


def test_colocated_memory_never_held_by_both(tiny_model_dir, tmp_path, monkeypatch):
    """Colocated with offload: the engines get only their weights back before a sync (the trainer still
    holds its memory then) and the rest (KV cache, CUDA graphs) after the trainer offloads. Asking for
    all of it before the offload killed a 3B SGLang server on the H200 (docs/gpu-results.md, session 8)."""
    log = tmp_path / "order.log"
    # On a CPU nothing is handed over (both live in host memory); the order is the same code on a GPU.
    monkeypatch.setattr(loop, "hands_memory_over", lambda cfg, plan: True)
    monkeypatch.setenv("SLIME_MEMORY_ORDER_LOG", str(log))
    cfg = standin_config(tiny_model_dir, tmp_path, monkeypatch, prompts=8, overrides=[
        "data.rollout_batch_size=2", "data.n_samples_per_prompt=2", "rollout.max_response_len=8",
        "rollout.engine=memory_order:RecordingEngine", "trainer.backend=memory_order:RecordingTrainer",
        "cluster.colocate=true", "cluster.offload=true",
    ])
    assert train(cfg)["steps"] == 2
    events = log.read_text().splitlines()
    one_step = ["engine release", "trainer onload", "trainer train", "engine resume weights", "engine weights",
                "trainer offload", "engine resume all"]
    assert events == ["trainer offload", *one_step, *one_step], events
