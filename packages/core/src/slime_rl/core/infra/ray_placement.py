"""The placement plan (`placement.plan_placement`) reserved on a Ray cluster.

On GPUs: one ``{GPU: 1}`` bundle per planned GPU, packed, as slime does; trainer rank i
takes its planned bundle with the plan's share of its GPU, and the rollout worker goes to
the node of engine 0's first bundle, where it starts the engines on their planned GPUs. PACK does not keep
the group's bundle order by node (the scale simulation found 4-GPU engines and tensor-parallel groups spread
over two nodes, docs/scale.md): planned bundle i takes the i-th of the group's bundles ordered by node
(`node_order`, as slime reorders its bundles), so a planned node's bundles share a Ray node wherever
Ray gave that node whole planned nodes. On the CPU: nothing to reserve while the plan has one node
(every process runs on the driver's Ray node); a plan over several nodes
(``cluster.num_gpus_per_node`` smaller than what the run needs) reserves one bundle per
planned node, each on a different Ray node (STRICT_SPREAD), and every process goes to its
planned node's bundle. That is what puts a CPU trainer on one node and its engine on another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slime_rl.core.config.placement import Placement

# A token CPU share: a Ray bundle needs some resource, our actors ask for none (they take
# every core for one phase at a time; cluster.num_cpus sizes the local Ray).
_NODE_BUNDLE_CPU = 0.01


@dataclass
class Reservation:
    plan: Placement
    group: Any = None  # a Ray placement group, or None: schedule anywhere
    by_node: bool = False  # CPU over several nodes: one bundle per node
    order: list[int] | None = None  # GPUs: planned bundle -> the group's bundle on the right node (node_order)

    def trainer_options(self, rank: int) -> dict[str, Any]:
        """ray.remote options for trainer rank ``rank`` (actor or critic: they share the bundle)."""
        if self.group is None:
            return {"num_cpus": 0}
        planned = self.plan.trainer[rank]
        if self.by_node:
            return {"num_cpus": 0, **self._in_bundle(planned.node)}
        return {"num_cpus": 0, "num_gpus": self.plan.trainer_gpu_share, **self._in_bundle(planned.bundle)}

    def rollout_options(self) -> dict[str, Any]:
        """ray.remote options for the rollout worker: on the node of engine 0's first GPU (slot on the
        CPU), asking for none of it; the engine starts its servers there on the GPUs the plan gives them."""
        if self.group is None:
            return {"num_cpus": 0}
        first = self.plan.bundles[self.plan.engines[0].bundles[0]]
        return {"num_cpus": 0, **self._in_bundle(first.node if self.by_node else first.index)}

    def role_options(self, name: str) -> dict[str, Any]:
        """ray.remote options for role ``name``'s actor (core/run/role_workers.py): on its first planned bundle's
        node; an hf role takes a tenth of that GPU (it shares the bundle with the trainer's 0.4 shares or an
        engine's), an sglang role none (its server is a child process on the GPUs `role_gpu_ids` gives)."""
        if self.group is None:
            return {"num_cpus": 0}
        planned = next(r for r in self.plan.roles if r.name == name)
        first = self.plan.bundles[planned.bundles[0]]
        if self.by_node:
            return {"num_cpus": 0, **self._in_bundle(first.node)}
        return {"num_cpus": 0, "num_gpus": 0.1 if planned.engine == "hf" else 0, **self._in_bundle(first.index)}

    def role_gpu_ids(self, name: str) -> list[int] | None:
        """The local GPU indexes role ``name``'s server runs on (None on the CPU)."""
        if self.plan.device != "cuda":
            return None
        return [gpu for _, gpu in next(r for r in self.plan.roles if r.name == name).gpus]

    def _in_bundle(self, index: int) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = self.order[index] if self.order is not None else index
        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(self.group, bundle)}


def node_order(bundle_nodes: dict[int, str], count: int) -> list[int]:
    """The group's bundle indexes with those of one Ray node together: nodes in the order their first bundle
    comes, a node's bundles in index order (``bundle_nodes``: placement_group_table's bundles_to_node_id)."""
    by_node: dict[str, list[int]] = {}
    for index in range(count):
        by_node.setdefault(bundle_nodes[index], []).append(index)
    return [index for indexes in by_node.values() for index in indexes]


def reserve(plan: Placement, timeout_s: float = 120.0) -> Reservation:
    """Reserve ``plan``'s GPUs (or nodes) on the running Ray cluster; fail with the counts when it cannot."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    if plan.device == "cuda":
        bundles, strategy, unit = [{"GPU": 1, "CPU": 1}] * len(plan.bundles), "PACK", "GPUs"
        have = f"it sees {ray.cluster_resources().get('GPU', 0):g} GPUs; check cluster.* GPU counts"
    elif plan.num_nodes > 1:
        bundles, strategy, unit = [{"CPU": _NODE_BUNDLE_CPU}] * plan.num_nodes, "STRICT_SPREAD", "nodes"
        alive = sum(1 for node in ray.nodes() if node["Alive"])
        have = (f"it has {alive} live node(s); start more (docs/multi-node.md) or raise cluster.num_gpus_per_node"
                " so the plan needs fewer")
    else:
        return Reservation(plan)
    group = placement_group(bundles, strategy=strategy)
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise RuntimeError(f"Ray could not reserve {len(bundles)} {unit} in {timeout_s:.0f} s ({have})")
    if plan.device != "cuda":
        return Reservation(plan, group, by_node=True)
    from ray.util import placement_group_table

    order = node_order(placement_group_table(group)["bundles_to_node_id"], len(bundles))
    return Reservation(plan, group, order=order)
