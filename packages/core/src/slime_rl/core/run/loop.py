"""The training loop: synchronous, colocated or not, on Ray. Reads top to bottom (`train`).

    for step in range(start, num_steps):
        rollout worker: generate, reward, filter; the batch into the object store, one shard per DP rank
        trainer ranks, each on its shard: old/ref log-probs, values (PPO), advantages, train step
        sync weights to the engines (version = step + 1)
        eval every eval.interval, checkpoint every checkpoint.save_interval

The driver passes object references and reads metrics: it never holds per-token data.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from slime_rl.core.config import Config, ConfigError, RunFailedError
from slime_rl.core.config.builtin_models import resolve_model_paths
from slime_rl.core.config.dtype import resolve_model_dtype
from slime_rl.core.config.placement import Placement, plan_placement
from slime_rl.core.infra.net import LOOPBACK, port_to_bind_later
from slime_rl.core.infra.private_files import keep_files_private
from slime_rl.core.infra.ray_cluster import check_ray_environment, local_ray
from slime_rl.core.infra.ray_placement import Reservation, reserve
from slime_rl.core.infra.stall import Party, StallBounds, StallWatch
from slime_rl.core.roles.endpoints import ROLES_FILE_NAME
from slime_rl.core.run import checkpoint, disk_full, folder_lock
from slime_rl.core.run.actors import BatchRefs, RolloutWorker, TrainerWorker
from slime_rl.core.run.metrics import MetricsLogger, phase
from slime_rl.core.run.resume_check import check_resume, data_identity
from slime_rl.core.run.role_workers import Roles
from slime_rl.core.run.run_dir import claim_logging_dir, new_run_id, record_logs, rollout_state_dir
from slime_rl.core.run.stopping import ending_on_signals
from slime_rl.core.weights.sync import WeightSync

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle

# (event, payload): "start", "step" (a failed step's payload has "failure": why), "eval", "done"
Callback = Callable[[str, dict[str, Any]], None]


class TrainerGroup:
    """The trainer's ranks as Ray actors, one method per `TrainerWorker` call the run makes. Every call
    goes to all ranks at once (they are collective); what the driver reads comes from rank 0 (the
    others answer None). Methods returning references leave them unread: they go to other actors.
    Every wait is ``watch``'s (infra/stall.py): bounded by the call's history, naming the ranks pending."""

    def __init__(self, cfg: Config, role: Literal["actor", "critic"], reservation: Reservation, watch: StallWatch):
        import ray

        world = cfg.actor_num_gpus
        self.role, self.watch = role, watch
        master_addr, master_port = _rendezvous_address(reservation, watch)
        self.workers: list[ActorHandle] = [
            ray.remote(**reservation.trainer_options(rank))(TrainerWorker).remote(
                cfg.to_dict(reveal_secrets=True), rank=rank, world_size=world, master_addr=master_addr,
                master_port=master_port, role=role)
            for rank in range(world)
        ]
        label = "trainer rank" if role == "actor" else "critic rank"
        for rank, worker in enumerate(self.workers):
            watch.register(worker, Party(f"{label} {rank}"))

    def wait_ready(self) -> None:
        """Once every rank is built (`TrainerWorker.ready` raises a rank's construction error); then each
        rank's pid, which a stall warning names."""
        import ray

        self._rank0("start", [w.ready.remote() for w in self.workers])
        here = ray.get_runtime_context().get_node_id()
        for worker, (node, pid) in zip(self.workers, self._all("start", [w.process.remote() for w in self.workers]),
                                       strict=True):
            self.watch.register(worker, Party(self.watch.party(worker).label, pid, local=node == here))

    def node_ids(self) -> list[str]:
        return self._all("start", [w.node_id.remote() for w in self.workers])

    def compute_values(self, shards: list[ObjectRef]) -> list[ObjectRef]:
        """Critic: each rank's values of its shard (`TrainerWorker.compute_values`), unread."""
        return [w.compute_values.remote(shard) for w, shard in zip(self.workers, shards, strict=True)]

    def prepare(self, shards: list[ObjectRef], values: list[ObjectRef] | list[None]
                ) -> tuple[dict[str, float], list[ObjectRef]]:
        """`TrainerWorker.prepare` of each rank's shard (with the critic's values of it). Once all are
        done: rank 0's timings, and each rank's returns unread (the critic's targets, for its `train`)."""
        refs = [w.prepare.options(num_returns=2).remote(shard, value)
                for w, shard, value in zip(self.workers, shards, values, strict=True)]
        return self._rank0("prepare", [timings for timings, _ in refs]), [returns for _, returns in refs]

    def train(self, returns: list[ObjectRef] | None = None) -> dict[str, float]:
        """`TrainerWorker.train` on the prepared shards (a critic's rank r on ``returns[r]``); rank 0's metrics."""
        per_rank = returns if returns is not None else [None] * len(self.workers)
        return self._rank0("train", [w.train.remote(r) for w, r in zip(self.workers, per_rank, strict=True)])

    def weight_buckets(self, bucket_bytes: int, folder: str | None, version: int = 0,
                       engines_hold: int | None = None) -> list[ObjectRef]:
        """`TrainerWorker.weight_buckets` on every rank, unread: rank 0's reference holds the buckets
        (arrays, or files in ``folder``; deltas onto ``engines_hold`` where it can), the others' say when
        each rank is done with the gather."""
        return [w.weight_buckets.remote(bucket_bytes, folder, version, engines_hold) for w in self.workers]

    def weight_digest(self) -> tuple[list[str], str] | None:
        """Rank 0's names and digest of the weights last synced (delta mode; core/weights/delta.py)."""
        return self.watch.get(f"{self.role} weight_sync", [self.workers[0].weight_digest.remote()],
                              self.workers[:1])[0]

    def weight_sync_metrics(self) -> dict[str, float]:
        """Rank 0's ``weights/*`` metrics of the last sync (core/weights/delta.py)."""
        return self.watch.get(f"{self.role} weight_sync", [self.workers[0].weight_sync_metrics.remote()],
                              self.workers[:1])[0]

    def push_weights(self, sender_spec: str, handle: Any, bucket_bytes: int, version: int, transport: str) -> None:
        """`TrainerWorker.push_weights` on every rank: the weights straight to the engine's servers."""
        self._rank0("weight_sync", [w.push_weights.remote(sender_spec, handle, bucket_bytes, version, transport)
                                    for w in self.workers])

    def save(self, path: str) -> None:
        self._rank0("save", [w.save.remote(path) for w in self.workers])

    def save_hf(self, path: str) -> None:
        self._rank0("save_hf", [w.save_hf.remote(path) for w in self.workers])

    def load(self, path: str) -> None:
        self._rank0("load", [w.load.remote(path) for w in self.workers])

    def offload(self) -> None:
        self._rank0("offload", [w.offload.remote() for w in self.workers])

    def onload(self) -> None:
        self._rank0("onload", [w.onload.remote() for w in self.workers])

    def _rank0(self, call: str, refs: list[ObjectRef]) -> Any:
        """Rank 0's result, once every rank is done (the others return None: no N copies)."""
        return self._all(call, refs)[0]

    def _all(self, call: str, refs: list[ObjectRef]) -> list[Any]:
        """Every rank's result of ``call``, under the watch's bound for this group's ``call``."""
        return self.watch.get(f"{self.role} {call}", refs, self.workers)


@dataclass
class Run:
    """The actors of a running job and the plan they were placed by."""

    cfg: Config
    plan: Placement
    actor: TrainerGroup
    critic: TrainerGroup | None  # the value model of an estimator that needs one (ppo), on the actor's GPUs
    rollout: Any  # the RolloutWorker actor
    weight_sync: WeightSync
    run_id: str
    offload: bool  # colocated on GPUs: trainer and engines take turns with the memory (slime's --offload)
    watch: StallWatch  # every wait of the driver, bounded (infra/stall.py)
    roles: Roles | None = None  # served models beside the policy (teacher, reward model, judges); frozen

    def ask_rollout(self, call: str, ref: ObjectRef) -> Any:
        """The rollout worker's answer to ``ref``, under the watch's bound for ``call``."""
        return self.watch.get(call, [ref], [self.rollout])[0]

    def shards_for_ranks(self, rollout: BatchRefs) -> list[Any]:
        """Each trainer rank's shard reference: the one of its data-parallel rank."""
        return [rollout.shards[rank.dp_rank] for rank in self.plan.trainer]


def train(cfg: Config, callback: Callback | None = None) -> dict[str, Any]:
    """Run (or resume) a training job; returns a summary (steps, eval before and after, paths).

    ``cluster.async_mode``: ``one_step`` runs one step off-policy (rollout k+1 overlaps training on
    rollout k); ``fully`` generates all the time and trains on the next eligible groups
    (core/fully_async.py), the weights landing in the engines mid-request."""
    with folder_lock.claims_released():  # the folders _check_start claimed are free once the run ends
        return _train(cfg, callback)


def _train(cfg: Config, callback: Callback | None) -> dict[str, Any]:

    notify = callback or (lambda event, payload: None)
    resolve_model_paths(cfg)  # builtin: -> HF folders before any backend sees them (done already under slime-cli)
    resumed, run_id = _check_start(cfg)
    summary: dict[str, Any] = {"log_dir": cfg.logging.dir, "checkpoint_dir": str(cfg.checkpoint_dir)}
    # A stop signal leaves the run after local_ray's cleanup, as one line (run/stopping.py).
    with ending_on_signals(cfg) as stops, local_ray(cfg):
        stops.arm()  # after ray.init, which sets its own SIGTERM handler
        notify = stops.follow(notify)
        started = time.perf_counter()
        run = _start(cfg, run_id, summary, StallWatch(StallBounds.from_config(cfg)))
        logger = MetricsLogger(cfg.logging.dir, tensorboard=cfg.logging.tensorboard,
                               wandb_project=cfg.logging.wandb_project, config=cfg.to_dict(),
                               resume_step=resumed[1]["step"] if resumed is not None else None)
        record_logs(cfg.logging.dir)  # run.json lists the logs this run writes (run_dir.py), from the first
        step = summary["start_step"] = _resume(run, resumed)
        notify("start", {"start_step": step, "num_steps": cfg.data.num_rollout, "startup_s": time.perf_counter() - started})
        last_eval = _evaluate(run, step, logger, notify) if cfg.eval.prompt_data else None
        if last_eval is not None:
            summary["eval_before"] = last_eval[1]
        last_save = step if resumed is not None else None
        failed_steps = 0  # consecutive rollout steps with too many failed samples
        # One-step-off async (disaggregated only): rollout k+1 runs on the engines while the
        # trainer trains on rollout k; the weights are synced once both are done.
        one_step, fully = cfg.cluster.async_mode == "one_step", cfg.cluster.async_mode == "fully"
        pending = run.rollout.run_step.remote(step + 1) if one_step else None
        if fully:
            run.ask_rollout("rollout", run.rollout.start_fully_async.remote())
        while cfg.data.num_rollout is None or step < cfg.data.num_rollout:
            timings: dict[str, float] = {}
            for note in run.roles.check() if run.roles else []:  # a role that stopped answering is restarted
                print(f"slime-rl: {note}", file=sys.stderr, flush=True)
            step_start = time.perf_counter()
            with phase(timings, "rollout"):
                if pending is None:
                    pending = (run.rollout.next_batch.remote(step + 1) if fully
                               else run.rollout.run_step.remote(step + 1))
                rollout: BatchRefs = run.ask_rollout("rollout", pending)
            metrics = rollout.metrics
            pending = None
            if rollout.failure is not None:
                # The step trains on nothing and syncs nothing; it counts as a step (its data is
                # used up). Enough of them in a row end the run.
                failed_steps, step = failed_steps + 1, step + 1
                logger.log(step, {**metrics, **timings})
                notify("step", {"step": step, "metrics": {**metrics, **timings}, "failure": rollout.failure})
                if failed_steps >= cfg.rollout.max_failed_steps:
                    logger.close()
                    run.ask_rollout("shutdown", run.rollout.shutdown.remote())
                    raise RunFailedError(
                        f"rollout.max_failed_steps: {failed_steps} steps in a row failed (the last, step {step}: "
                        f"{rollout.failure}); fix the reward (or filter, or generate function), or raise "
                        "rollout.max_failed_fraction or rollout.max_failed_steps")
            elif not rollout.shards:
                break
            else:
                failed_steps = 0
                # How many versions behind the trainer the samples' weights are (1 when one step off).
                metrics["rollout/weight_version_lag"] = step - rollout.mean_weight_version
            this_step = step if rollout.failure is not None else step + 1
            if one_step and not rollout.exhausted and (
                    cfg.data.num_rollout is None or this_step < cfg.data.num_rollout):
                pending = run.rollout.run_step.remote(this_step + 1)
            if rollout.failure is not None:
                if rollout.exhausted:
                    break
                continue
            metrics.update(_train_on(run, rollout, timings))
            if pending is not None:
                with phase(timings, "wait_rollout"):
                    run.ask_rollout("wait_rollout", pending)  # no weight update in the middle of a rollout
            summary["weight_sync"] = _sync_after_train(run, step + 1, timings)
            metrics.update(run.weight_sync.metrics)  # change fraction and bytes moved (core/weights/delta.py)
            step += 1
            timings["time/step"] = time.perf_counter() - step_start
            metrics["perf/tokens_per_s"] = rollout.num_tokens / timings["time/step"]
            if cfg.eval.prompt_data and cfg.eval.interval and step % cfg.eval.interval == 0:
                last_eval = _evaluate(run, step, None, notify)
                metrics.update(last_eval[1])
            if cfg.checkpoint.save_interval and step % cfg.checkpoint.save_interval == 0:
                with phase(timings, "save"):
                    _save(run, step)
                last_save = step
            logger.log(step, {**metrics, **timings})
            record_logs(cfg.logging.dir)
            notify("step", {"step": step, "metrics": {**metrics, **timings}})
            if rollout.exhausted:
                break

        if cfg.eval.prompt_data and last_eval is not None and last_eval[0] != step:
            last_eval = _evaluate(run, step, logger, notify)
        if last_eval is not None:
            summary["eval_after"] = last_eval[1]
        if (cfg.checkpoint.save_interval or cfg.checkpoint.save_dir) and last_save != step:
            _save(run, step)
        logger.close()
        record_logs(cfg.logging.dir)
        if run.roles is not None:
            run.roles.shutdown()
        run.ask_rollout("shutdown", run.rollout.shutdown.remote())
        summary.update(steps=step, elapsed_s=time.perf_counter() - started, metrics_file=str(logger.jsonl_path))
        notify("done", summary)
    return summary


def _check_start(cfg: Config) -> tuple[tuple[Path, dict[str, Any]] | None, str]:
    """Before anything starts: a resume's checkpoint is there and verified (CheckpointError says what
    is wrong and the way on), a fresh run overwrites nothing, Ray's network is safe, model.dtype is
    concrete (config/dtype.py: every backend builds in it), and the logging folder is this run's.
    Returns the checkpoint to resume and the run id."""
    keep_files_private()  # before anything is written; Ray's processes inherit it (infra/private_files.py)
    check_ray_environment()  # Ray's network and authentication: refused before anything is written
    save_dir = cfg.checkpoint_dir
    if not cfg.checkpoint.resume or save_dir.is_dir():  # (a resume from nowhere is refused just below)
        folder_lock.claim("checkpoint.save_dir", save_dir)  # another run's is refused before anything reads it
    resumed = checkpoint.resume_point(save_dir) if cfg.checkpoint.resume else None
    if resumed is not None:  # the later step folders it will save into are its own (checkpoint.prepare)
        checkpoint.check_steps_ahead(save_dir, resumed[1]["step"], resumed[1].get("run_id"))
    previous = checkpoint.earlier_run(save_dir)  # its latest, or step folders whose latest was removed
    if previous is not None and not cfg.checkpoint.resume:
        raise ConfigError(
            "checkpoint.save_dir",
            f"{save_dir} holds the checkpoints of an earlier run ({previous}); continue"
            " it with --resume (checkpoint.resume=true), or give this run another checkpoint.save_dir",
        )
    folder_lock.claim("logging.dir", Path(cfg.logging.dir))  # its rollout state and weight folders too
    if note := resolve_model_dtype(cfg, resumed[1] if resumed is not None else None):
        print(f"slime-rl: {note}", file=sys.stderr, flush=True)
    if resumed is not None:  # every change since the checkpoint: honoured (said) or refused (named, the fix)
        check_resume(cfg, resumed[1])
    # A run's buffer, rollout state and logs are its own (run_dir.py): a fresh run neither
    # consumes nor mixes with an earlier one's; a resumed run continues its own.
    run_id = (resumed[1].get("run_id") if resumed is not None else None) or new_run_id()
    for note in claim_logging_dir(Path(cfg.logging.dir), run_id, resuming=resumed is not None):
        print(f"slime-rl: {note}", file=sys.stderr, flush=True)
    return resumed, run_id


def _start(cfg: Config, run_id: str, summary: dict[str, Any], watch: StallWatch) -> Run:
    """Reserve the plan's bundles, start the trainer ranks (and critic) and the rollout worker, and
    wait until every one is built: a broken backend fails here, before any rollout."""
    import ray

    plan = plan_placement(cfg)  # the plan `slime-cli plan` prints
    reservation = reserve(plan)
    actor = TrainerGroup(cfg, "actor", reservation, watch)
    critic = TrainerGroup(cfg, "critic", reservation, watch) if plan.critic else None  # the estimator needs one
    log_dir = Path(cfg.logging.dir)
    rollout = ray.remote(**reservation.rollout_options())(RolloutWorker).remote(
        cfg.to_dict(reveal_secrets=True), str(rollout_state_dir(log_dir, run_id)), str(log_dir))
    watch.register(rollout, Party(f"the rollout worker (engine {cfg.rollout.engine})"))
    watch.get("rollout start", [rollout.ping.remote()], [rollout])
    if cfg.rollout.elastic.enabled:  # the control endpoint, for `slime-cli engines` (core/run/control.py)
        summary["control_url"] = watch.get("rollout start", [rollout.start_elastic.remote()], [rollout])[0]
    rollout_node, rollout_pid = watch.get("rollout start", [rollout.process.remote()], [rollout])[0]
    here = ray.get_runtime_context().get_node_id()
    watch.register(rollout, Party(watch.party(rollout).label, rollout_pid, local=rollout_node == here))
    # Roles once the rollout engines are up: on a shared GPU the second server must see the first's memory taken.
    roles = Roles(cfg, reservation, watch, rollout_state_dir(log_dir, run_id) / ROLES_FILE_NAME) if cfg.roles else None
    if roles is not None:
        roles.wait_ready()
    actor.wait_ready()
    if critic is not None:
        critic.wait_ready()
    summary["nodes"] = {"trainer": sorted(set(actor.node_ids())), "rollout": rollout_node}
    return Run(cfg, plan, actor, critic, rollout, WeightSync(cfg, plan, actor, rollout, watch), run_id,
               hands_memory_over(cfg, plan), watch, roles)


def hands_memory_over(cfg: Config, plan: Placement) -> bool:
    """Whether trainer and engines take turns with the device memory: colocated with offload, on GPUs
    (on a CPU both live in host memory, so there is nothing to hand over)."""
    return cfg.offload and plan.device == "cuda"


def _resume(run: Run, resumed: tuple[Path, dict[str, Any]] | None) -> int:
    """Load the checkpoint to resume (trainer, critic, data and buffer state) and send its weights to
    the engines; then hand the GPU memory to the engines when colocated. Returns the first step."""

    start_step = 0
    if resumed is not None:
        folder, meta = resumed
        run.actor.load(str(folder / "actor"))
        if run.critic is not None:
            run.critic.load(str(folder / "critic"))
        run.ask_rollout("load", run.rollout.load_state_dict.remote(meta["rollout_state"]))
        start_step = meta["step"]
        run.weight_sync.sync(version=start_step)
    if run.offload:
        run.actor.offload()
    return start_step


def _train_on(run: Run, rollout: BatchRefs, timings: dict[str, float]) -> dict[str, float]:
    """One training step on the rollout's shards: each trainer rank fetches its own shard, adds
    log-probs, values and advantages to it, and trains. Returns the train (and critic) metrics."""

    if run.offload:
        with phase(timings, "offload_rollout"):
            run.ask_rollout("release_memory", run.rollout.release_memory.remote())
        with phase(timings, "onload_train"):
            run.actor.onload()
    shards = run.shards_for_ranks(rollout)
    metrics: dict[str, float] = {}
    with phase(timings, "prepare"):
        values = run.critic.compute_values(shards) if run.critic else [None] * len(shards)
        prepare_timings, returns = run.actor.prepare(shards, values)
        timings.update(prepare_timings)
    with phase(timings, "train"):
        if run.critic is not None:
            metrics.update({f"critic/{k}": v for k, v in run.critic.train(returns).items()})
        metrics.update({f"train/{k}": v for k, v in run.actor.train().items()})
    return metrics


def _sync_after_train(run: Run, version: int, timings: dict[str, float]) -> str:
    """Send the new weights to the engines as ``version`` (the GPU memory back to them first when
    colocated, and back to the engines after). Returns which path the weights took."""

    # Only the engines' weights come back before the sync: their KV cache and CUDA graphs (most of
    # their memory) wait until the trainer has offloaded, so the two never hold the GPU at once.
    if run.offload:
        with phase(timings, "onload_rollout_weights"):
            run.ask_rollout("resume_memory_weights", run.rollout.resume_memory.remote(["weights"]))
    with phase(timings, "weight_sync"):
        path = run.weight_sync.sync(version=version)
    if run.offload:
        with phase(timings, "offload_train"):
            run.actor.offload()
        with phase(timings, "onload_rollout"):
            run.ask_rollout("resume_memory", run.rollout.resume_memory.remote())
    return path


def _evaluate(run: Run, step: int, logger: MetricsLogger | None, notify: Callback) -> tuple[int, dict[str, float]]:
    """The eval sets' metrics at ``step``, logged as their own row when ``logger`` is given."""

    metrics = run.ask_rollout("eval", run.rollout.evaluate.remote())
    if logger is not None:
        logger.log(step, metrics)
    notify("eval", {"step": step, "metrics": metrics})
    return step, metrics


def _rendezvous_address(reservation: Reservation, watch: StallWatch) -> tuple[str, int]:
    """Where trainer rank 0 listens for the others: loopback when every rank shares a node, else
    rank 0's node address; the port is one found free on rank 0's node."""
    import ray

    if reservation.group is None:
        return LOOPBACK, port_to_bind_later()
    one_node = len({r.node for r in reservation.plan.trainer}) == 1

    def address() -> tuple[str, int]:
        host = LOOPBACK if one_node else ray.util.get_node_ip_address()
        return host, port_to_bind_later(host)

    options = reservation.trainer_options(0)
    options.pop("num_gpus", None)  # a lookup: it needs the node, not the GPU
    return watch.get("rendezvous", [ray.remote(**options)(address).remote()], ["the rendezvous lookup"])[0]


def _save(run: Run, step: int) -> None:

    folder = checkpoint.prepare(run.cfg.checkpoint_dir, step, run.run_id)  # a folder this run made
    needs = ("actor", *(("hf",) if run.cfg.checkpoint.save_hf else ()), *(("critic",) if run.critic else ()))
    with disk_full.save_guard(folder, run.cfg.checkpoint_dir):  # a full disk: one line, no partial folder
        run.actor.save(str(folder / "actor"))
        if run.cfg.checkpoint.save_hf:  # an HF folder beside it (with trainer.lora: a PEFT adapter folder)
            run.actor.save_hf(str(folder / "hf"))
        if run.critic is not None:
            run.critic.save(str(folder / "critic"))
        state = run.ask_rollout("save", run.rollout.state_dict.remote())
        # model_dtype: what auto resolved to; config and data: what a resume compares with (resume_check.py)
        meta = {"rollout_state": state, "run_id": run.run_id, "model_dtype": run.cfg.model.dtype,
                "config": run.cfg.to_dict(), "data": data_identity(run.cfg)}
        checkpoint.commit(run.cfg.checkpoint_dir, step, meta, keep_last=run.cfg.checkpoint.keep_last, needs=needs)
