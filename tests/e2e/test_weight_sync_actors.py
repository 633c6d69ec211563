"""WeightSync between the real actors on CPU, apart from the training step: the Megatron trainer ranks
push to stand-in SGLang servers (a test double) through the engine's sender, or hand their buckets to
the transformers engine as shared-memory files. The plan is built once and is what the actors run on."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from standin import fake_sglang_python

from slime_rl.core.config import load_config
from slime_rl.core.config.placement import plan_placement
from slime_rl.core.infra.ray_cluster import local_ray
from slime_rl.core.infra.ray_placement import reserve
from slime_rl.core.infra.stall import StallBounds, StallWatch
from slime_rl.core.run.actors import RolloutWorker
from slime_rl.core.run.loop import TrainerGroup
from slime_rl.core.weights.sync import WeightSync


def standin_events(logs: Path) -> list[dict]:
    """The stand-in servers' recorded calls; their ports are in their log files' names."""
    ports = [re.search(r"port(\d+)\.log$", p.name).group(1) for p in logs.glob("sglang-engine-*.log")]
    assert ports, f"no server logs in {logs}"
    return [e for port in ports for e in httpx.get(f"http://127.0.0.1:{port}/standin/state", timeout=10).json()["events"]]


@pytest.mark.slow
@pytest.mark.parametrize(("engine", "transport", "path"), [("sglang", "tensor", "engine"), ("sglang", "disk", "engine"),
                                                           ("hf", "auto", "files")])
def test_weight_sync_between_the_real_actors(engine, transport, path, tiny_model_dir, tmp_path, monkeypatch):
    import ray

    if engine == "sglang":
        pytest.importorskip("aiohttp", reason="the stand-in server needs slime-rl-rollout-sglang[test]")
    monkeypatch.setenv("SLIME_RL_TORCH_THREADS", "1")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input": "def f(", "label": ""}) + "\n")
    run = tmp_path / "run"
    cfg = load_config(None, [
        f"model.path={tiny_model_dir}", f"data.prompt_data={prompts}", "data.rollout_batch_size=1",
        "data.n_samples_per_prompt=2", "rollout.max_response_len=4", f"rollout.engine={engine}",
        f"rollout.sglang.engine_python={fake_sglang_python(tmp_path)}", f"rollout.update_weight_transport={transport}",
        "rollout.sglang.check_weight_update=true", "cluster.device=cpu", "model.dtype=float32", f"logging.dir={run}",
        "logging.tensorboard=false",
    ])
    plan = plan_placement(cfg)
    with local_ray(cfg):
        reservation = reserve(plan)
        actor = TrainerGroup(cfg, "actor", reservation, watch := StallWatch(StallBounds.from_config(cfg)))
        rollout = ray.remote(**reservation.rollout_options())(RolloutWorker).remote(cfg.to_dict(), str(tmp_path / "s"))
        try:
            ray.get(rollout.ping.remote())
            actor.wait_ready()
            weight_sync = WeightSync(cfg, plan, actor, rollout, watch)
            assert (weight_sync.path, weight_sync.transport) == (path, transport if engine == "sglang" else None)
            assert [weight_sync.sync(version=v) for v in (1, 2)] == [path, path]
            assert ray.get(rollout.weight_version.remote()) == 2
            if engine == "sglang":
                update = {"tensor": "update_weights_from_tensor", "disk": "update_weights_from_disk"}[transport]
                pushed = [e for e in standin_events(run / "sglang" / "logs") if e["kind"] == update]
                # the trainer's weights reached the servers, the version with each sync's last bucket
                assert [e["weight_version"] for e in pushed if e["weight_version"]] == ["1", "2"]
                if transport == "disk":  # written where the engine restores from
                    assert pushed[-1]["model_path"] == str(run / "sglang" / "weights" / "v2")
        finally:
            ray.get(rollout.shutdown.remote())
