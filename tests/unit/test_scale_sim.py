"""The scale simulation (benchmarks/scale_sim.py, docs/scale.md) at its small size: 4 planned nodes of 8 fake GPUs
on 2 Ray nodes, 32 trainer ranks in 2 rank hosts, 8 stand-in SGLang engines behind the real router, a real step.
Behaviour only (placement, every sample trained once, message counts per rank and per engine); the costs'
figures are the benchmark's to print. The larger sizes and a dead engine: tests/e2e/test_scale_sim_dead_engine.py."""

from __future__ import annotations

from scale_sim import run_scale_sim

from slime_rl.core.infra.ray_placement import node_order
from slime_rl.core.testing.scale_checkpoint import MoEShape, RankGrid, write_checkpoint_metadata


def test_node_order_puts_each_ray_nodes_bundles_together():
    """PACK left bundles 0-3 of a 4-GPU engine on two nodes; planned bundle i takes the i-th of the group's
    bundles ordered by node, so consecutive planned bundles share a node."""
    nodes = {0: "a", 1: "b", 2: "a", 3: "b", 4: "a", 5: "b", 6: "a", 7: "b"}
    order = node_order(nodes, 8)
    assert sorted(order) == list(range(8))
    assert [nodes[i] for i in order] == ["a"] * 4 + ["b"] * 4


def test_checkpoint_metadata_of_many_ranks_is_complete_and_grows_at_most_linearly(tmp_path):
    """torch's own planner accepts every rank's plan (it refuses overlapping or missing chunks), the commit's
    check finds every rank's file, and the items grow no faster than the ranks."""
    from slime_rl.core.infra.safe_pickle import check_dcp_folder
    from slime_rl.core.run.checkpoint_contents import missing_files

    costs = {}
    for world in (32, 128):
        folder = tmp_path / str(world)
        costs[world] = write_checkpoint_metadata(folder / "actor", MoEShape(layers=1), RankGrid(world, 2, 2, 4))
        assert missing_files(folder, ("actor",)) == []
        check_dcp_folder(folder / "actor")
        assert len(list((folder / "actor").glob("__*_0.distcp"))) == world
    assert costs[128].items <= 4 * costs[32].items
    assert costs[128].metadata_bytes <= 4 * costs[32].metadata_bytes


def test_small_size_places_trains_every_sample_once_and_counts_messages_per_rank_and_engine(tmp_path):
    [r] = run_scale_sim(tmp_path, "--sizes", "small", "--steps", "1", "--no-kill", "--health-window", "0")
    ranks, engines, hosts = r["ranks"], r["engines"], 2
    assert (ranks, engines) == (32, 8)
    assert r["placement"]["bundles"] == ranks and r["placement"]["problems"] == []
    for step in r["steps"]:
        assert step["samples"] == step["expected_samples"] and step["positions_trained_once"] == 1.0
        # the real loop's calls: prepare, train and weight sync, one per rank each (here one per host), and the
        # sync's metrics from rank 0
        assert step["rank_calls"] == 3 * ranks + 1 and step["host_calls"] == 3 * hosts + 1
        assert step["requests"] >= step["expected_samples"]  # every sample a /generate through the router (retries more)
        # a sync's fan-out: one bucket and one cache flush per engine, nothing more
        assert step["sync"]["http"] == {"/update_weights_from_tensor": engines, "/flush_cache": engines}
    assert sum(r["startup"]["http"].values()) <= 6 * engines  # attaching: /health, /server_info, /model_info
    assert r["startup"]["rank_calls"] == ranks and r["checkpoint"]["missing"] == []


def test_shards_deal_each_sample_to_the_least_loaded_rank_as_the_scan_did():
    """RolloutBatch.shard with a heap (it scanned every rank for every sample: samples x DP a step) deals the
    same samples to the same ranks: longest first, each to the rank with the fewest tokens, the lowest of equals."""
    import random

    from slime_rl.core.batch import RolloutBatch
    from slime_rl.core.sample import Sample

    rng = random.Random(0)
    samples = []
    for i in range(96):
        n = rng.randint(1, 40)
        samples.append(Sample(index=i, group_index=i // 4, tokens=[1, 2] + [5] * n, response_length=n,
                              loss_mask=[1] * n, rollout_log_probs=[-1.0] * n, reward=1.0))
    batch = RolloutBatch.from_samples(samples)
    dp, per_step = 8, 32
    lengths = batch.lengths.tolist()
    expected = [[] for _ in range(dp)]
    for start in range(0, len(samples), per_step):
        load, mine = [0] * dp, [[] for _ in range(dp)]
        for i in sorted(range(start, start + per_step), key=lambda i: (-lengths[i], i)):
            rank = min(range(dp), key=lambda r: (load[r], r))
            mine[rank].append(i)
            load[rank] += lengths[i]
        for rank in range(dp):
            expected[rank] += sorted(mine[rank])
    assert [shard.positions.tolist() for shard in batch.shard(dp, per_step)] == expected
