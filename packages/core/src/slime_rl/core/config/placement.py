"""Where the trainer ranks and rollout engines go: a plan made from the config alone.

Like slime, one list of GPU bundles (a process slot each on CPU), ordered by
node then local GPU index, as a Ray placement group with the PACK strategy
fills them. The trainer takes bundles ``0 .. actor_gpus-1``. Rollout engines
take ``rollout_num_gpus_per_engine`` consecutive bundles each, starting at
bundle 0 when colocated (they share the trainer's GPUs) and right after the
trainer's bundles when disaggregated. A PPO critic shares the trainer's bundles.
On GPUs each trainer process asks Ray for a share of its GPU (``trainer_gpu_share``):
0.4 when the engines share it (slime's colocation fraction), half with a critic beside it,
else all of it.

The plan is built once (`plan_placement`) and is what runs: ``slime-cli plan`` prints it,
`ray_placement.reserve` reserves its bundles, the trainer ranks go to their planned bundles
and the rollout engines take their planned GPUs (rollout_sglang's launch reads ``engines``).

Trainer ranks follow megatron-core's default rank order ``tp-cp-ep-dp-pp``
(``parallel_state.initialize_model_parallel``): tensor-parallel rank varies
fastest, then context-parallel, then data-parallel, then pipeline stage:
``rank = tp + TP * (cp + CP * (dp + DP * pp))`` (expert parallelism regroups the same ranks).
The CP ranks of one DP rank share its shard of the batch, each holding part of every sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from slime_rl.core.algorithms.registry import advantage_estimator_of
from slime_rl.core.config.device import Device, resolve_device
from slime_rl.core.config.schema import Config, ConfigError  # not .config: its checks import this module

COLOCATED_GPU_SHARE = 0.4  # a trainer process's share of a GPU it shares with an engine (slime's)


@dataclass(frozen=True)
class Bundle:
    index: int  # position in the placement group
    node: int  # planned node index (Ray decides the actual machine)
    gpu: int  # GPU index on that node (a process slot on CPU)


@dataclass(frozen=True)
class TrainerRank:
    rank: int  # global rank in torch.distributed
    bundle: int
    node: int
    gpu: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    cp_rank: int = 0  # context-parallel rank: which 2 of the 2 * CP chunks of each sequence it holds


@dataclass(frozen=True)
class EnginePlacement:
    index: int
    bundles: tuple[int, ...]  # consecutive bundles; the first hosts the engine's rank 0
    gpus: tuple[tuple[int, int], ...]  # (node, gpu) per engine rank


@dataclass(frozen=True)
class RolePlacement:
    """A served role (config/roles.py): its own bundles after the rollout's, or the rollout engines' first ones."""

    name: str
    kind: str
    engine: str
    bundles: tuple[int, ...]
    gpus: tuple[tuple[int, int], ...]  # (node, gpu) per engine rank
    colocated: bool  # shares the rollout engines' GPUs


@dataclass
class Placement:
    device: Device
    colocate: bool
    num_gpus_per_node: int
    bundles: list[Bundle]
    trainer: list[TrainerRank]
    engines: list[EnginePlacement]
    rollout_offset: int  # first bundle of the engines
    critic: bool = False  # PPO: a critic shares the trainer's bundles
    trainer_gpu_share: float = 1.0  # what each trainer process (actor, critic) asks Ray for of its GPU
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    roles: list[RolePlacement] = field(default_factory=list)  # served models beside the policy

    @property
    def num_nodes(self) -> int:
        return self.bundles[-1].node + 1 if self.bundles else 0

    def format(self) -> str:
        """A plain-text table, one row per bundle: which trainer rank and engine use it."""
        unit = "GPU" if self.device == "cuda" else "slot"
        mode = "colocated: engines share the trainer's GPUs" if self.colocate else (
            f"disaggregated: engines start at bundle {self.rollout_offset}")
        share = f"; each trainer process takes {self.trainer_gpu_share:g} of its GPU" if self.device == "cuda" else ""
        lines = [
            f"placement on {self.device}: {len(self.bundles)} {unit}s on {self.num_nodes} node(s), {mode}",
            f"trainer: {len(self.trainer)} ranks, TP={self.tp}" + (f" CP={self.cp}" if self.cp > 1 else "")
            + f" PP={self.pp} DP={self.dp} (megatron order {'tp-cp-dp-pp' if self.cp > 1 else 'tp-dp-pp'})"
            + ("; the PPO critic shares these ranks" if self.critic else "") + share,
            f"rollout: {len(self.engines)} engine(s) x {len(self.engines[0].bundles) if self.engines else 0} {unit}(s)",
        ]
        coordinates = "(tp, cp, pp, dp)" if self.cp > 1 else "(tp, pp, dp)"
        rows = [("bundle", "node", unit.lower(), f"trainer rank {coordinates}", "engine")]
        trainer_at = {r.bundle: r for r in self.trainer}
        engine_at = {b: (e.index, i) for e in self.engines for i, b in enumerate(e.bundles)}
        for b in self.bundles:
            r = trainer_at.get(b.index)
            cp = f"{r.cp_rank}, " if self.cp > 1 else ""
            rank = f"{r.rank} ({r.tp_rank}, {cp}{r.pp_rank}, {r.dp_rank})" if r else "-"
            eng = f"{engine_at[b.index][0]} (rank {engine_at[b.index][1]})" if b.index in engine_at else "-"
            rows.append((str(b.index), str(b.node), str(b.gpu), rank, eng))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
        lines += [f"role {r.name} ({r.kind}, engine {r.engine}, frozen): {unit.lower()}s "
                  + ", ".join(f"{b} (node {n}, {unit.lower()} {g})" for b, (n, g) in zip(r.bundles, r.gpus, strict=True))
                  + (", shared with the rollout engines" if r.colocated else ", its own") for r in self.roles]
        return "\n".join(lines)


def plan_placement(cfg: Config, device: Device | None = None) -> Placement:
    """Bundles, trainer ranks and engines for ``cfg``. Starts nothing; raises
    :class:`ConfigError` for a layout that cannot be placed."""
    c, p = cfg.cluster, cfg.parallel
    per_node = cfg.num_gpus_per_node
    if c.actor_num_gpus_per_node > per_node:
        raise ConfigError(
            "cluster.actor_num_gpus_per_node",
            f"{c.actor_num_gpus_per_node} trainer GPUs per node exceed cluster.num_gpus_per_node = {per_node}",
        )
    actor, rollout, engine_size = cfg.actor_num_gpus, cfg.rollout_num_gpus, c.rollout_num_gpus_per_engine
    offset = 0 if c.colocate else actor
    total = max(actor, rollout) if c.colocate else actor + rollout
    own_role_gpus = sum(role.num_gpus for role in cfg.roles.values() if not role.colocate)
    total += own_role_gpus
    bundles = [Bundle(index=i, node=i // per_node, gpu=i % per_node) for i in range(total)]

    tp, cp, pp = p.tensor_model_parallel_size, p.context_parallel_size, p.pipeline_model_parallel_size
    dp = actor // (tp * cp * pp)
    trainer = []
    for rank in range(actor):
        b = bundles[rank]
        trainer.append(TrainerRank(rank=rank, bundle=b.index, node=b.node, gpu=b.gpu, tp_rank=rank % tp,
                                   cp_rank=(rank // tp) % cp, dp_rank=(rank // (tp * cp)) % dp,
                                   pp_rank=rank // (tp * cp * dp)))

    engines = []
    for e in range(rollout // engine_size):
        own = bundles[offset + e * engine_size : offset + (e + 1) * engine_size]
        nodes = {b.node for b in own}
        # An engine's tensor-parallel group must sit on one node, or span whole nodes.
        fits = len(nodes) == 1 if engine_size <= per_node else (own[0].gpu == 0 and engine_size % per_node == 0)
        if not fits:
            raise ConfigError(
                "cluster.rollout_num_gpus_per_engine",
                f"engine {e} would span GPUs {own[0].gpu}..{own[-1].gpu} across nodes {sorted(nodes)}"
                f" (bundles {own[0].index}..{own[-1].index}, {per_node} GPUs per node); an engine's GPUs must share a"
                " node: choose an engine size that divides the GPUs left on each node",
            )
        engines.append(EnginePlacement(index=e, bundles=tuple(b.index for b in own),
                                       gpus=tuple((b.node, b.gpu) for b in own)))

    critic = advantage_estimator_of(cfg.algorithm).needs_critic
    share = COLOCATED_GPU_SHARE if c.colocate else (0.5 if critic else 1.0)
    return Placement(
        device=device or resolve_device(c.device), colocate=c.colocate, num_gpus_per_node=per_node, bundles=bundles,
        trainer=trainer, engines=engines, rollout_offset=offset, critic=critic, trainer_gpu_share=share,
        tp=tp, pp=pp, dp=dp, cp=cp, roles=_place_roles(cfg, bundles, total - own_role_gpus, offset),
    )


def _place_roles(cfg: Config, bundles: list[Bundle], first_free: int, rollout_offset: int) -> list[RolePlacement]:
    """Each role's bundles: its own ones from ``first_free`` on, in config order, or (colocate) the first ones
    of the rollout engines; a role's GPUs share one node, like an engine's."""
    placed, at = [], first_free
    for name, role in cfg.roles.items():
        start = rollout_offset if role.colocate else at
        own = bundles[start:start + role.num_gpus]
        if len(own) < role.num_gpus:
            raise ConfigError(f"roles.{name}.num_gpus", f"{role.num_gpus} GPUs to share with the rollout engines,"
                              f" which have {len(own)}; lower it or set roles.{name}.colocate=false")
        if len({b.node for b in own}) > 1:
            raise ConfigError(f"roles.{name}.num_gpus", f"the role would span nodes {sorted({b.node for b in own})};"
                              " a role's GPUs must share a node: choose a size that fits the GPUs left on one node")
        placed.append(RolePlacement(name=name, kind=role.kind, engine=role.engine, bundles=tuple(b.index for b in own),
                                    gpus=tuple((b.node, b.gpu) for b in own), colocated=role.colocate))
        if not role.colocate:
            at += role.num_gpus
    return placed
