import pytest

from slime_rl.core.config import ConfigError, load_config
from slime_rl.core.config.placement import plan_placement


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"input": "1 + 1 =", "label": "2"}\n')
    return path


def config(prompts, *overrides, check=True):
    return load_config(None, [f"data.prompt_data={prompts}", "data.rollout_batch_size=8", "data.n_samples_per_prompt=8",
                              *overrides], check=check)


def test_colocated_engines_start_at_the_first_gpu(prompts):
    cfg = config(prompts, "cluster.actor_num_gpus_per_node=8", "cluster.rollout_num_gpus_per_engine=2")
    p = plan_placement(cfg, device="cuda")
    assert len(p.bundles) == 8 and p.rollout_offset == 0
    assert [r.bundle for r in p.trainer] == list(range(8))
    assert [e.bundles for e in p.engines] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert p.engines[1].gpus == ((0, 2), (0, 3))


def test_disaggregated_engines_follow_the_trainer(prompts):
    cfg = config(prompts, "cluster.actor_num_gpus_per_node=4", "cluster.colocate=false", "cluster.rollout_num_gpus=4",
                 "cluster.rollout_num_gpus_per_engine=2", "cluster.async_mode=one_step")
    p = plan_placement(cfg, device="cuda")
    assert len(p.bundles) == 8 and p.rollout_offset == 4
    trainer_bundles = {r.bundle for r in p.trainer}
    engine_bundles = {b for e in p.engines for b in e.bundles}
    assert trainer_bundles == {0, 1, 2, 3} and engine_bundles == {4, 5, 6, 7}


def test_bundles_fill_nodes_in_order(prompts):
    # two 4-GPU trainer nodes, then one more node of engines
    cfg = config(prompts, "cluster.actor_num_nodes=2", "cluster.actor_num_gpus_per_node=4", "cluster.num_gpus_per_node=4",
                 "cluster.colocate=false", "cluster.rollout_num_gpus=4", "cluster.rollout_num_gpus_per_engine=4")
    p = plan_placement(cfg, device="cuda")
    assert p.num_nodes == 3
    assert [(r.node, r.gpu) for r in p.trainer] == [(n, g) for n in (0, 1) for g in range(4)]
    assert p.engines[0].gpus == tuple((2, g) for g in range(4))


def test_disaggregated_on_one_big_node(prompts):
    # slime's default node size is 8: 4 trainer GPUs and 4 engine GPUs share node 0
    cfg = config(prompts, "cluster.actor_num_gpus_per_node=4", "cluster.colocate=false", "cluster.rollout_num_gpus=4")
    p = plan_placement(cfg, device="cuda")
    assert p.num_nodes == 1 and [e.gpus for e in p.engines] == [((0, g),) for g in range(4, 8)]


def test_megatron_rank_order_tp_fastest_then_dp_then_pp(prompts):
    cfg = config(prompts, "cluster.actor_num_gpus_per_node=8", "parallel.tensor_model_parallel_size=2",
                 "parallel.pipeline_model_parallel_size=2")
    p = plan_placement(cfg, device="cuda")
    assert (p.tp, p.pp, p.dp) == (2, 2, 2)
    assert [(r.tp_rank, r.dp_rank, r.pp_rank) for r in p.trainer] == [
        (0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 0, 1), (1, 0, 1), (0, 1, 1), (1, 1, 1)]
    # every (tp, pp, dp) coordinate appears exactly once
    assert len({(r.tp_rank, r.pp_rank, r.dp_rank) for r in p.trainer}) == 8


def test_ppo_critic_shares_the_trainer(prompts):
    p = plan_placement(config(prompts, "algorithm.advantage_estimator=ppo"), device="cpu")
    assert p.critic
    assert "critic" in p.format()
    assert not plan_placement(config(prompts), device="cpu").critic


def test_format_has_one_row_per_bundle(prompts):
    cfg = config(prompts, "cluster.actor_num_gpus_per_node=2", "cluster.colocate=false", "cluster.rollout_num_gpus=2")
    text = plan_placement(cfg, device="cuda").format()
    lines = text.splitlines()
    assert lines[0].startswith("placement on cuda: 4 GPUs on 1 node(s), disaggregated")
    header = next(i for i, line in enumerate(lines) if line.startswith("bundle"))
    rows = [line.split() for line in lines[header + 1:]]
    assert [row[0] for row in rows] == ["0", "1", "2", "3"]
    assert rows[0][3] == "0" and rows[0][-1] == "-"  # trainer rank 0, no engine
    assert rows[2][3] == "-" and rows[2][-3:] == ["0", "(rank", "0)"]  # engine 0 on bundle 2
    cpu = plan_placement(cfg, device="cpu").format()
    assert "4 slots" in cpu and "GPU" not in cpu


def test_device_auto_follows_torch():
    import torch

    cfg = load_config(None, [], check=False)
    assert plan_placement(cfg).device == ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = load_config(None, ["cluster.device=cpu"], check=False)
    assert plan_placement(cfg).device == "cpu"


def test_engine_across_nodes_is_refused(prompts):
    cfg = config(prompts, "cluster.actor_num_gpus_per_node=3", "cluster.num_gpus_per_node=4", "cluster.colocate=false",
                 "cluster.rollout_num_gpus=4", "cluster.rollout_num_gpus_per_engine=2", "data.n_samples_per_prompt=3",
                 check=False)
    with pytest.raises(ConfigError, match="cluster.rollout_num_gpus_per_engine: engine 0 would span"):
        plan_placement(cfg)


def test_engines_bigger_than_a_node_take_whole_nodes(prompts):
    cfg = config(prompts, "cluster.actor_num_nodes=2", "cluster.actor_num_gpus_per_node=4", "cluster.num_gpus_per_node=4",
                 "cluster.rollout_num_gpus_per_engine=8")
    p = plan_placement(cfg, device="cuda")
    assert len(p.engines) == 1 and {node for node, _ in p.engines[0].gpus} == {0, 1}


@pytest.mark.parametrize(("overrides", "share"), [
    ((), 0.4),  # colocated: an engine shares each trainer GPU (slime's fraction)
    (("cluster.colocate=false", "cluster.rollout_num_gpus=2"), 1.0),
    (("cluster.colocate=false", "cluster.rollout_num_gpus=2", "algorithm.advantage_estimator=ppo"), 0.5),
    (("algorithm.advantage_estimator=ppo",), 0.4),  # actor and critic each 0.4 of a shared GPU
])
def test_each_trainer_process_asks_ray_for_the_planned_share_of_its_gpu(prompts, overrides, share):
    cfg = config(prompts, "cluster.actor_num_gpus_per_node=2", *overrides)
    plan = plan_placement(cfg, device="cuda")
    assert plan.trainer_gpu_share == share
    assert (1 + plan.critic) * share <= 1.0  # actor and critic fit in their one-GPU bundle
    assert f"each trainer process takes {share:g} of its GPU" in plan.format()
    assert "of its GPU" not in plan_placement(cfg, device="cpu").format()  # on the CPU Ray hands out no GPUs


def test_the_reservation_schedules_what_the_plan_says(prompts):
    """Trainer rank i goes to its planned bundle with the plan's GPU share; the rollout worker to engine
    0's first bundle (disaggregated: the first after the trainer's)."""
    from slime_rl.core.infra.ray_placement import Reservation

    cfg = config(prompts, "cluster.actor_num_gpus_per_node=2", "cluster.colocate=false", "cluster.rollout_num_gpus=2")
    plan = plan_placement(cfg, device="cuda")
    group = object()  # stands for a Ray placement group: the options only name it
    reservation = Reservation(plan, group)
    for rank in range(2):
        options = reservation.trainer_options(rank)
        strategy = options.pop("scheduling_strategy")
        assert options == {"num_cpus": 0, "num_gpus": 1.0}
        assert strategy.placement_group is group and strategy.placement_group_bundle_index == plan.trainer[rank].bundle
    options = reservation.rollout_options()
    assert "num_gpus" not in options  # the servers it starts are not Ray's to count
    assert options["scheduling_strategy"].placement_group_bundle_index == plan.engines[0].bundles[0] == 2
    # Nothing reserved (one CPU node): anywhere.
    assert Reservation(plan).trainer_options(0) == Reservation(plan).rollout_options() == {"num_cpus": 0}


def test_a_cpu_plan_over_several_nodes_reserves_one_bundle_per_node(prompts):
    from slime_rl.core.infra.ray_placement import Reservation

    cfg = config(prompts, "cluster.actor_num_gpus_per_node=2", "cluster.num_gpus_per_node=2", "cluster.colocate=false",
                 "cluster.rollout_num_gpus=2")
    plan = plan_placement(cfg, device="cpu")
    assert plan.num_nodes == 2
    reservation = Reservation(plan, object(), by_node=True)
    assert [reservation.trainer_options(r)["scheduling_strategy"].placement_group_bundle_index for r in range(2)] == [0, 0]
    assert "num_gpus" not in reservation.trainer_options(0)
    assert reservation.rollout_options()["scheduling_strategy"].placement_group_bundle_index == 1  # engine 0's node
