"""plan_placement's trainer ranks agree with megatron-core's own rank groups (its default order)."""

import inspect

import pytest
from megatron.core import parallel_state

from slime_rl.core.config import load_config
from slime_rl.core.config.placement import plan_placement


@pytest.mark.parametrize("gpus,tp,pp", [(8, 2, 2), (8, 1, 4), (8, 4, 1), (16, 2, 4), (12, 3, 2)])
def test_trainer_ranks_match_megatron_groups(gpus, tp, pp):
    order = inspect.signature(parallel_state.initialize_model_parallel).parameters["order"].default
    dp = gpus // (tp * pp)
    gen = parallel_state.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order=order)
    cfg = load_config(None, [f"cluster.actor_num_gpus_per_node={gpus}", f"parallel.tensor_model_parallel_size={tp}",
                             f"parallel.pipeline_model_parallel_size={pp}", "data.source=my.custom:Source"],
                      check=False)
    by_rank = {r.rank: r for r in plan_placement(cfg, device="cuda").trainer}
    assert sorted(by_rank) == list(range(gpus))
    for kind, attr in (("tp", "tp_rank"), ("dp", "dp_rank"), ("pp", "pp_rank")):
        others = {"tp_rank", "dp_rank", "pp_rank"} - {attr}
        for group in gen.get_ranks(kind):
            # within a megatron group, our rank in that dimension is the position, the other two are constant
            assert [getattr(by_rank[r], attr) for r in group] == list(range(len(group)))
            for other in others:
                assert len({getattr(by_rank[r], other) for r in group}) == 1


@pytest.mark.parametrize("gpus,tp,cp,pp", [(8, 2, 2, 1), (8, 1, 4, 2), (16, 2, 2, 2), (12, 1, 3, 2)])
def test_context_parallel_ranks_match_megatron_groups(gpus, tp, cp, pp):
    order = inspect.signature(parallel_state.initialize_model_parallel).parameters["order"].default
    dp = gpus // (tp * cp * pp)
    gen = parallel_state.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    cfg = load_config(None, [f"cluster.actor_num_gpus_per_node={gpus}", f"parallel.tensor_model_parallel_size={tp}",
                             f"parallel.context_parallel_size={cp}", f"parallel.pipeline_model_parallel_size={pp}",
                             "data.source=my.custom:Source"], check=False)
    placement = plan_placement(cfg, device="cuda")
    assert (placement.cp, placement.dp, cfg.data_parallel_size) == (cp, dp, dp)
    by_rank = {r.rank: r for r in placement.trainer}
    attrs = ("tp_rank", "cp_rank", "dp_rank", "pp_rank")
    for kind, attr in (("tp", "tp_rank"), ("cp", "cp_rank"), ("dp", "dp_rank"), ("pp", "pp_rank")):
        for group in gen.get_ranks(kind):
            assert [getattr(by_rank[r], attr) for r in group] == list(range(len(group)))
            for other in set(attrs) - {attr}:
                assert len({getattr(by_rank[r], other) for r in group}) == 1
    text = placement.format()
    assert f"CP={cp}" in text and "(tp, cp, pp, dp)" in text
