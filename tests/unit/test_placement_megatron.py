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
