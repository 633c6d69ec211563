"""Where the servers start: each engine on the GPUs of the placement plan `slime-cli plan` prints."""

from __future__ import annotations

import pytest

from slime_rl.core.config import Config, ConfigError
from slime_rl.core.config.placement import plan_placement
from slime_rl.rollout_sglang.launch import engine_gpu_ids, server_host


def plan(device: str = "cuda", **cluster):
    cfg = Config.model_validate({"rollout": {"engine": "sglang"}, "cluster": cluster})
    return plan_placement(cfg, device=device)


def test_colocated_engines_take_the_trainers_gpus_from_the_first():
    p = plan(actor_num_gpus_per_node=4, rollout_num_gpus_per_engine=2)
    assert engine_gpu_ids(p, visible="") == [[0, 1], [2, 3]]


def test_disaggregated_engines_take_the_gpus_after_the_trainers():
    p = plan(actor_num_gpus_per_node=2, colocate=False, rollout_num_gpus=4, rollout_num_gpus_per_engine=2)
    assert engine_gpu_ids(p, visible="") == [[2, 3], [4, 5]]
    assert engine_gpu_ids(p, visible="") == [[gpu for _, gpu in e.gpus] for e in p.engines]  # the plan's, as printed


def test_planned_gpus_are_read_through_cuda_visible_devices():
    p = plan(actor_num_gpus_per_node=2, colocate=False, rollout_num_gpus=2)
    assert engine_gpu_ids(p, visible="4,5,6,7") == [[6], [7]]
    # fewer visible GPUs than the plan uses (Ray hid them from this process): the plan's indices are physical
    assert engine_gpu_ids(p, visible="0") == [[2], [3]]


def test_no_gpus_on_the_cpu():
    assert engine_gpu_ids(plan("cpu", actor_num_gpus_per_node=2), visible="0,1") is None


def test_engines_planned_on_several_nodes_are_refused_with_the_way_out():
    p = plan(actor_num_gpus_per_node=4, num_gpus_per_node=4, colocate=False, rollout_num_gpus=4,
             rollout_num_gpus_per_engine=2, actor_num_nodes=1)
    # both engines on node 1, on its GPUs 0..3 (not 4..7, past the 4 GPUs the node has)
    assert engine_gpu_ids(p, visible="") == [[0, 1], [2, 3]]
    p = plan(actor_num_gpus_per_node=4, num_gpus_per_node=4, actor_num_nodes=2, rollout_num_gpus_per_engine=2)
    assert {node for e in p.engines for node, _ in e.gpus} == {0, 1}
    with pytest.raises(ConfigError, match=r"cluster.rollout_num_gpus: the plan puts the SGLang engines on nodes"
                                          r" \[0, 1\].*rollout.sglang.engine_urls"):
        engine_gpu_ids(p, visible="")


def test_servers_listen_on_loopback_unless_the_plan_spans_nodes():
    assert server_host(plan(actor_num_gpus_per_node=2)) == "127.0.0.1"
