"""The scale simulation's layouts, its fake-GPU Ray cluster, the placement check and its meters
(benchmarks/scale_sim.py, docs/scale.md).

A few Ray nodes on this host advertise fake GPUs, so the placement of 64 to 1,024 bundles is Ray's real
placement of `config.placement`'s plan (`infra.ray_placement.reserve`, PACK); `check_placement` says
whether the bundles landed where the plan needs them (an engine's GPUs and a tensor-parallel group on one
node). The run itself is scale_run.py's; the meters here read a process's CPU seconds and memory from /proc,
so costs are CPU time and message counts, not wall time under contention.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from slime_rl.core.config.placement import Placement

TICKS = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class Layout:
    """One simulated size: ``gpus`` trainer GPUs (colocated: the engines share them), TP x PP x DP (x EP
    within DP) ranks, engines of ``engine_gpus`` GPUs, on ``ray_nodes`` Ray nodes of this host and
    ``hosts`` rank-host actors. A step rolls out ``prompts_per_engine`` prompts per engine, ``samples``
    each, of ``response_len`` tokens."""

    gpus: int
    tp: int = 2
    pp: int = 2
    ep: int = 4
    engine_gpus: int = 8
    gpus_per_node: int = 8
    ray_nodes: int = 4
    hosts: int = 4
    prompts_per_engine: int = 4
    samples: int = 4
    response_len: int = 8

    @property
    def engines(self) -> int:
        return self.gpus // self.engine_gpus

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def prompts(self) -> int:
        return self.engines * self.prompts_per_engine

    def describe(self) -> str:
        return (f"{self.gpus} GPUs: TP{self.tp} PP{self.pp} DP{self.dp} EP{self.ep}, {self.engines} engines x "
                f"{self.engine_gpus} GPUs, {self.ray_nodes} Ray nodes, {self.hosts} rank hosts")

    def overrides(self, *, model: Path, prompts: Path, run_dir: Path, engine_urls: list[str]) -> list[str]:
        """The run's config: the real sglang engine attached to the stand-in fleet, the stand-in ranks."""
        return [
            f"model.path={model}", f"data.prompt_data={prompts}", f"data.rollout_batch_size={self.prompts}",
            f"data.n_samples_per_prompt={self.samples}", f"rollout.max_response_len={self.response_len}",
            "rollout.engine=sglang", f"rollout.sglang.engine_urls={json.dumps(engine_urls)}",
            "rollout.update_weight_transport=tensor", "rollout.reward=slime_rl.core.testing.scale:half_right",
            "rollout.reward_workers=0", f"rollout.max_concurrency={max(64, 4 * self.prompts * self.samples)}",
            "trainer.backend=slime_rl.core.testing.scale_ranks:StandinRank", "cluster.device=cpu",
            f"cluster.actor_num_nodes={self.gpus // self.gpus_per_node}",
            f"cluster.actor_num_gpus_per_node={self.gpus_per_node}", f"cluster.num_gpus_per_node={self.gpus_per_node}",
            f"cluster.rollout_num_gpus_per_engine={self.engine_gpus}",
            f"parallel.tensor_model_parallel_size={self.tp}", f"parallel.pipeline_model_parallel_size={self.pp}",
            f"parallel.expert_model_parallel_size={self.ep}", "cluster.offload=false",
            f"logging.dir={run_dir / 'logs'}", f"checkpoint.save_dir={run_dir / 'ckpt'}",
            "logging.tensorboard=false", "model.dtype=float32",
        ]


def half_right(sample) -> float:
    """The simulation's reward: every other sample right, so a group's advantages are not all zero."""
    return float(sample.index % 2)


# ---------------------------------------------------------------- the cluster


@contextmanager
def fake_gpu_cluster(layout: Layout, object_store_mb: int = 150) -> Iterator[Any]:
    """``layout.ray_nodes`` Ray nodes on this host (ray.cluster_utils.Cluster), the layout's GPUs spread
    over them in whole planned nodes, each bundle's CPU with them; this process is the driver."""
    import ray
    from ray.cluster_utils import Cluster

    planned_nodes = layout.gpus // layout.gpus_per_node
    per_ray_node = -(-planned_nodes // layout.ray_nodes) * layout.gpus_per_node
    common = {"node_ip_address": "127.0.0.1", "object_store_memory": object_store_mb * 2**20}
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": per_ray_node + 4, "num_gpus": per_ray_node, "include_dashboard": False, **common})
    try:
        for _ in range(layout.ray_nodes - 1):
            cluster.add_node(num_cpus=per_ray_node + 4, num_gpus=per_ray_node, **common)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=True, configure_logging=False)
        try:
            yield cluster
        finally:
            ray.shutdown()
    finally:
        cluster.shutdown()


def check_placement(plan: Placement, reservation: Any) -> list[str]:
    """What is wrong with where Ray put ``plan``'s bundles (``reservation``: `ray_placement.reserve`'s, its
    planned bundle -> group bundle order applied): one line per engine or tensor-parallel group spread over
    Ray nodes, per planned node split over Ray nodes, per bundle not placed; [] when right."""
    from ray.util import placement_group_table

    actual = placement_group_table(reservation.group)["bundles_to_node_id"]
    order = reservation.order or list(range(len(plan.bundles)))
    where = {planned: actual.get(order[planned]) for planned in range(len(plan.bundles))}
    problems = [f"bundle {b.index} was not placed" for b in plan.bundles if not where.get(b.index)]
    for engine in plan.engines:
        if len({where.get(b) for b in engine.bundles}) > 1:
            problems.append(f"engine {engine.index}: bundles {engine.bundles[0]}..{engine.bundles[-1]} on "
                            f"{len({where.get(b) for b in engine.bundles})} Ray nodes")
    tp_groups: dict[tuple[int, int], set] = {}
    for rank in plan.trainer:
        tp_groups.setdefault((rank.pp_rank, rank.dp_rank), set()).add(where.get(rank.bundle))
    problems += [f"tensor-parallel group (pp {pp}, dp {dp}) on {len(nodes)} Ray nodes"
                 for (pp, dp), nodes in tp_groups.items() if len(nodes) > 1]
    planned: dict[int, set] = {}
    for b in plan.bundles:
        planned.setdefault(b.node, set()).add(where.get(b.index))
    problems += [f"planned node {node} split over {len(nodes)} Ray nodes" for node, nodes in planned.items()
                 if len(nodes) > 1]
    return problems


# ---------------------------------------------------------------- meters


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * PAGE / 2**20


class CpuMeter:
    """CPU seconds of named processes over a stretch: ``with meter.over("sync") as took: ...``."""

    def __init__(self, pids: dict[str, int]):
        self.pids = pids

    def snapshot(self) -> dict[str, float]:
        return {name: cpu_s(pid) for name, pid in self.pids.items()}

    @contextmanager
    def over(self) -> Iterator[dict[str, float]]:
        took: dict[str, float] = {}
        before = self.snapshot()
        yield took
        after = self.snapshot()
        took.update({name: after[name] - before[name] for name in before})


def request_counts(fleet_state: dict) -> dict[str, int]:
    """Requests the fleet's engines answered, by path, summed over engines."""
    total: dict[str, int] = {}
    for engine in fleet_state["engines"]:
        for path, n in engine["requests"].items():
            total[path] = total.get(path, 0) + n
    return total


def count_diff(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


# ---------------------------------------------------------------- growth


def growth_exponent(sizes: list[int], costs: list[float]) -> float:
    """The least-squares slope of log(cost) on log(size): 1 is linear, 2 quadratic; nan with a cost <= 0."""
    if len(sizes) < 2 or min(costs) <= 0:
        return math.nan
    xs, ys = [math.log(s) for s in sizes], [math.log(c) for c in costs]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def at_most_linear(sizes: list[int], costs: list[float], slack: float = 1.25) -> bool:
    """Whether cost grew no faster than size from the smallest to the largest (``slack`` for noise)."""
    return costs[-1] <= costs[0] * (sizes[-1] / sizes[0]) * slack


def as_row(obj: Any) -> dict[str, Any]:
    return asdict(obj) if hasattr(obj, "__dataclass_fields__") else dict(obj)
