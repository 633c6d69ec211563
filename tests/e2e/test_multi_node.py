"""The multi-node path without a second machine: a two-node Ray cluster on this host (two raylets
with their own resources, token authentication on), the trainer on one node and the rollout engine
on the other, the CPU loop through the cross-node paths (weights through the object store, not
the same-node /dev/shm files), a checkpoint and a resume."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from test_e2e_sglang_standin import fake_sglang_python

from slime_rl.core.run import checkpoint

# Started in its own process: Ray reads its environment (auth, loopback) when first imported.
CLUSTER = """
import sys
from ray.cluster_utils import Cluster

store = 200 * 1024**2
cluster = Cluster(initialize_head=True, head_node_args={
    "num_cpus": 0, "include_dashboard": False, "node_ip_address": "127.0.0.1", "object_store_memory": store})
for _ in range(2):  # each worker node has room for one planned node (cluster.num_gpus_per_node=1)
    cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1", object_store_memory=store)
cluster.wait_for_nodes()
print(cluster.address, flush=True)
sys.stdin.read()  # until the test closes our stdin
cluster.shutdown()
"""
TRAIN = ("import json, sys; from slime_rl.core.config import load_config; from slime_rl.core.run.loop import train; "
         "s = train(load_config(None, sys.argv[1:])); print(json.dumps({**s['nodes'], 'sync': s['weight_sync']}))")


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["hf", "sglang"])
def test_trainer_and_engine_on_two_nodes_train_checkpoint_and_resume(engine, tiny_model_dir, tmp_path):
    """With the SGLang engine (stand-in servers on the CPU), the trainer rank on the other node
    pushes the weights to the servers itself, over their private address and with their key."""
    if engine == "sglang":
        pytest.importorskip("aiohttp", reason="the stand-in server needs slime-rl-rollout-sglang[test]")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input": f"x{i} = ", "label": str(i)}) + "\n" for i in range(20)))
    run_dir = tmp_path / "run"
    env = {**os.environ, "TOY_TOKENIZER": str(tiny_model_dir), "PYTHONPATH": str(Path(__file__).parents[1] / "support"),
           "SLIME_RL_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1", "HOME": str(tmp_path / "home"),
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    cluster = subprocess.Popen([sys.executable, "-c", CLUSTER], env=env, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    try:
        address = cluster.stdout.readline().strip()
        assert address, "the two-node cluster did not start"
        overrides = [
            f"model.path={tiny_model_dir}", f"data.prompt_data={prompts}", "data.rollout_batch_size=2",
            "data.n_samples_per_prompt=2", "rollout.max_response_len=4",
            "rollout.reward=toy_rewards:digit_token_fraction", "cluster.device=cpu",
            "cluster.colocate=false", "cluster.num_gpus_per_node=1",  # the plan: trainer node 0, engine node 1
            f"logging.dir={run_dir}", "logging.tensorboard=false", "checkpoint.save_interval=2",
        ]
        if engine == "sglang":
            overrides += ["rollout.engine=sglang", f"rollout.sglang.engine_python={fake_sglang_python(tmp_path)}",
                          "rollout.update_weight_transport=tensor", "rollout.sglang.check_weight_update=true"]
        sync = "object_store" if engine == "hf" else "engine"  # hf: no same-machine shared-memory files

        def run(*extra: str) -> dict:
            done = subprocess.run([sys.executable, "-c", TRAIN, *overrides, *extra], capture_output=True, text=True,
                                  env={**env, "RAY_ADDRESS": address}, timeout=600)
            assert done.returncode == 0, done.stderr[-3000:]
            return json.loads(done.stdout.strip().splitlines()[-1])

        first = run("data.num_rollout=2")
        assert len(first["trainer"]) == 1 and first["rollout"] not in first["trainer"], first
        assert first["sync"] == sync, first
        assert checkpoint.latest(run_dir / "checkpoints")[1]["step"] == 2

        second = run("data.num_rollout=4", "checkpoint.resume=true")
        assert second["rollout"] not in second["trainer"] and second["sync"] == sync, second
    finally:
        cluster.stdin.close()
        cluster.wait(timeout=120)

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "rollout/tokens" in r] == [1, 2, 3, 4]
    # every step's rollout ran on the weights the trainer on the other node sent it
    assert all(r["rollout/weight_version_lag"] == 0.0 for r in rows if "rollout/weight_version_lag" in r)
    assert checkpoint.latest(run_dir / "checkpoints")[1]["step"] == 4
