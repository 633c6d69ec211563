"""The training loop: synchronous, colocated or not, on Ray. Reads top to bottom.

    for step in range(start, num_steps):
        samples = rollout()                       # generate, reward, filter (over-sampling)
        log-probs (old, ref), values (PPO)
        advantages
        train_step
        sync weights to the engines (version = step + 1)
        eval every eval.interval, checkpoint every checkpoint.save_interval
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from slime_rl.core import checkpoint
from slime_rl.core.actors import RolloutManager, TrainerWorker
from slime_rl.core.advantages import compute_advantages
from slime_rl.core.builtin_models import resolve_model_paths
from slime_rl.core.config import Config, ConfigError, RunFailedError
from slime_rl.core.cpu import MatmulShape, choose_cpu_dtype, cpu_info
from slime_rl.core.leftovers import weights_folder
from slime_rl.core.metrics import MetricsLogger
from slime_rl.core.net import LOOPBACK, free_port
from slime_rl.core.placement import plan_placement, resolve_device
from slime_rl.core.ray_cluster import check_ray_environment, local_ray
from slime_rl.core.ray_placement import Reservation, reserve
from slime_rl.core.run_dir import claim_logging_dir, new_run_id, rollout_state_dir
from slime_rl.core.sample import Sample

# (event, payload): "start", "step" (a failed step's payload has "failure": why), "eval", "done"
Callback = Callable[[str, dict[str, Any]], None]


class TrainerGroup:
    """The trainer's ranks as Ray actors; each method runs on all ranks and returns rank 0's answer."""

    def __init__(self, cfg: Config, role: str = "actor", reservation: Reservation | None = None):
        import ray

        reservation = reservation or Reservation(plan_placement(cfg))
        world = cfg.actor_num_gpus
        master_addr, master_port = _rendezvous_address(reservation)
        self.workers = [
            ray.remote(**reservation.trainer_options(rank, colocate=cfg.cluster.colocate))(TrainerWorker).remote(
                cfg.to_dict(), rank=rank, world_size=world, master_addr=master_addr, master_port=master_port,
                role=role)
            for rank in range(world)
        ]

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        import ray

        return ray.get([getattr(w, method).remote(*args, **kwargs) for w in self.workers])[0]

    def call_async(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return [getattr(w, method).remote(*args, **kwargs) for w in self.workers]


def _rendezvous_address(reservation: Reservation) -> tuple[str, int]:
    """Where trainer rank 0 listens for the others: loopback when every rank shares a node, else
    rank 0's node address; the port is one found free on rank 0's node."""
    import ray

    if reservation.group is None:
        return LOOPBACK, free_port()
    one_node = len({r.node for r in reservation.plan.trainer}) == 1

    def address() -> tuple[str, int]:
        host = LOOPBACK if one_node else ray.util.get_node_ip_address()
        return host, free_port(host)

    options = reservation.trainer_options(0, colocate=False)
    options.pop("num_gpus", None)  # a lookup: it needs the node, not the GPU
    return ray.get(ray.remote(**options)(address).remote())


def weight_transport(cfg: Config) -> str:
    """``auto``: CUDA IPC tensors when colocated, an NCCL broadcast when not."""
    if cfg.rollout.update_weight_transport != "auto":
        return cfg.rollout.update_weight_transport
    return "tensor" if cfg.cluster.colocate else "nccl"


def sync_weights(cfg: Config, actor: TrainerGroup, manager: Any, *, version: int) -> str:
    """Send the trainer's weights to the engines as ``version``.

    Engines with a trainer-side `weight_sender` (SGLang) get them straight from the trainer
    ranks; otherwise rank 0's buckets go to the rollout process (the driver never holds them):
    as shared-memory files the engine deletes when both run on one machine, else through the
    object store (tensor_transport says why files are preferred). Returns which path it took:
    ``engine`` (the engine's own sender), ``files`` or ``object_store``."""
    import ray

    bucket_bytes = cfg.rollout.update_weight_buffer_mb * 1024**2
    sender = ray.get(manager.weight_sender.remote())
    if sender is None:
        same_node = len(set(ray.get([manager.node_id.remote(), actor.workers[0].node_id.remote()]))) == 1
        files = weights_folder() if same_node else contextlib.nullcontext()
        with files as folder:  # None: through the object store
            refs = actor.call_async("weight_buckets", bucket_bytes, folder)
            ray.get([manager.update_weights.remote(refs[0], version), *refs[1:]])
        return "files" if same_node else "object_store"
    transport = weight_transport(cfg)
    handle = ray.get(manager.begin_weight_sync.remote(version, transport))
    ray.get(actor.call_async("push_weights", sender, handle, bucket_bytes, version, transport))
    ray.get(manager.end_weight_sync.remote(version))
    return "engine"


def save_rollouts(path: Path, samples: list[Sample]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(s.to_dict()) + "\n" for s in samples))


@contextlib.contextmanager
def phase(timings: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    timings[f"time/{name}"] = time.perf_counter() - start


def _attach(samples: list[Sample], field: str, values: list[list[float]]) -> None:
    for sample, value in zip(samples, values, strict=True):
        setattr(sample, field, value)


def train(cfg: Config, callback: Callback | None = None) -> dict[str, Any]:
    """Run (or resume) a training job; returns a summary (steps, eval before and after, paths).

    ``cluster.async`` runs one step off-policy: rollout k+1 overlaps training on rollout k."""
    resolve_model_paths(cfg)  # builtin: model paths -> HF folders, before any backend sees them (a no-op after slime-cli's wire)
    import ray

    notify = callback or (lambda event, payload: None)
    log_dir = Path(cfg.logging.dir)
    save_dir = cfg.checkpoint_dir
    algo = cfg.algorithm
    needs_ref = algo.use_kl_loss or algo.kl_coef != 0
    needs_critic = algo.advantage_estimator == "ppo"
    # Colocated on GPUs, trainer and engines take turns with the memory (slime's --offload).
    offload = cfg.offload and resolve_device(cfg) == "cuda"
    # One step per rollout and on-policy: the trainer's own log-probs before the update are
    # the old policy's, so it computes them in the training forward instead of a second pass.
    separate_old_pass = cfg.trainer.num_steps_per_rollout > 1 and not algo.use_rollout_logprobs
    summary: dict[str, Any] = {"log_dir": str(log_dir), "checkpoint_dir": str(save_dir)}
    # Before anything starts: a resume's checkpoint is there and verified (CheckpointError says what is
    # wrong and the way on), and a fresh run overwrites nothing.
    resumed = checkpoint.resume_point(save_dir) if cfg.checkpoint.resume else None
    previous = checkpoint.latest_name(save_dir)
    if previous is not None and not cfg.checkpoint.resume:
        raise ConfigError(
            "checkpoint.save_dir",
            f"{save_dir} holds the checkpoints of an earlier run (latest: {previous}); continue"
            " it with --resume (checkpoint.resume=true), or give this run another checkpoint.save_dir",
        )
    check_ray_environment()  # Ray's network and authentication: refused before anything is written
    if note := resolve_cpu_dtype(cfg, resumed[1] if resumed is not None else None):
        print(f"slime-rl: {note}", file=sys.stderr, flush=True)
    # A run's buffer, rollout state and logs are its own (run_dir.py): a fresh run neither
    # consumes nor mixes with an earlier one's; a resumed run continues its own.
    run_id = (resumed[1].get("run_id") if resumed is not None else None) or new_run_id()
    for note in claim_logging_dir(log_dir, run_id, resuming=resumed is not None):
        print(f"slime-rl: {note}", file=sys.stderr, flush=True)

    with local_ray(cfg):
        started = time.perf_counter()
        reservation = reserve(cfg)
        actor = TrainerGroup(cfg, "actor", reservation)
        critic = TrainerGroup(cfg, "critic", reservation) if needs_critic else None  # on the actor's GPUs
        manager = ray.remote(**reservation.rollout_options())(RolloutManager).remote(
            cfg.to_dict(), str(rollout_state_dir(log_dir, run_id)))
        ray.get(manager.ping.remote())
        actor.call("ready")  # every rank built: a broken backend fails here, before any rollout
        summary["nodes"] = {"trainer": sorted(set(ray.get([w.node_id.remote() for w in actor.workers]))),
                            "rollout": ray.get(manager.node_id.remote())}
        logger = MetricsLogger(log_dir, tensorboard=cfg.logging.tensorboard, wandb_project=cfg.logging.wandb_project,
                               config=cfg.to_dict(), resume_step=resumed[1]["step"] if resumed is not None else None)

        start_step = 0
        if resumed is not None:
            folder, meta = resumed
            actor.call("load", str(folder / "actor"))
            if critic is not None:
                critic.call("load", str(folder / "critic"))
            ray.get(manager.load_state_dict.remote(meta["rollout_state"]))
            start_step = meta["step"]
            sync_weights(cfg, actor, manager, version=start_step)
        if offload:
            actor.call("offload")
        summary["start_step"] = start_step
        notify("start", {"start_step": start_step, "num_steps": cfg.data.num_rollout,
                         "startup_s": time.perf_counter() - started})

        last_eval: tuple[int, dict[str, float]] | None = None
        if cfg.eval.prompt_data:
            last_eval = (start_step, ray.get(manager.evaluate.remote()))
            summary["eval_before"] = last_eval[1]
            logger.log(start_step, last_eval[1])
            notify("eval", {"step": start_step, "metrics": last_eval[1]})
        last_save = start_step if resumed is not None else None

        step = start_step
        failed_steps = 0  # consecutive rollout steps with too many failed samples
        # One-step-off async (disaggregated only): rollout k+1 runs on the engines while the
        # trainer trains on rollout k; the weights are synced once both are done.
        next_rollout = manager.generate.remote() if cfg.cluster.async_train else None
        while cfg.data.num_rollout is None or step < cfg.data.num_rollout:
            timings: dict[str, float] = {}
            step_start = time.perf_counter()
            with phase(timings, "rollout"):
                samples, metrics, exhausted, failure = ray.get(next_rollout or manager.generate.remote())
            if failure is not None:
                # Too many samples failed: the step trains on nothing and syncs nothing; it counts
                # as a step (its data is used up). Enough of them in a row end the run.
                failed_steps += 1
                step += 1
                if cfg.logging.save_rollouts and samples:
                    save_rollouts(log_dir / "rollouts" / f"step_{step:06d}.jsonl", samples)
                metrics.update(timings)
                logger.log(step, metrics)
                notify("step", {"step": step, "metrics": metrics, "failure": failure})
                if failed_steps >= cfg.rollout.max_failed_steps:
                    logger.close()
                    ray.get(manager.shutdown.remote())
                    raise RunFailedError(
                        f"rollout.max_failed_steps: {failed_steps} steps in a row failed (the last, step {step}: "
                        f"{failure}); fix the reward (or filter, or generate function), or raise "
                        "rollout.max_failed_fraction or rollout.max_failed_steps")
                more = not exhausted and (cfg.data.num_rollout is None or step < cfg.data.num_rollout)
                next_rollout = manager.generate.remote() if cfg.cluster.async_train and more else None
                if exhausted:
                    break
                continue
            failed_steps = 0
            if not samples:
                break
            # How many versions behind the trainer the samples' weights are (1 when one step off).
            metrics["rollout/weight_version_lag"] = sum(step - s.weight_version for s in samples) / len(samples)
            more = not exhausted and (cfg.data.num_rollout is None or step + 1 < cfg.data.num_rollout)
            next_rollout = manager.generate.remote() if cfg.cluster.async_train and more else None
            if cfg.logging.save_rollouts:
                save_rollouts(log_dir / "rollouts" / f"step_{step + 1:06d}.jsonl", samples)
            if offload:
                with phase(timings, "offload_rollout"):
                    ray.get(manager.release_memory.remote())
                with phase(timings, "onload_train"):
                    actor.call("onload")
            samples_ref = ray.put(samples)
            if separate_old_pass:
                with phase(timings, "log_probs"):
                    _attach(samples, "old_log_probs", actor.call("compute_log_probs", samples_ref, "actor"))
            if algo.use_rollout_logprobs:
                for s in samples:
                    s.old_log_probs = list(s.rollout_log_probs)
            if needs_ref:
                with phase(timings, "ref_log_probs"):
                    _attach(samples, "ref_log_probs", actor.call("compute_log_probs", samples_ref, "ref"))
            if critic is not None:
                with phase(timings, "values"):
                    _attach(samples, "values", critic.call("compute_values", samples_ref))
            compute_advantages(samples, algo, n_samples_per_prompt=cfg.data.n_samples_per_prompt,
                               reward_key=cfg.rollout.reward_key)
            samples_ref = ray.put(samples)
            with phase(timings, "train"):
                if critic is not None:
                    metrics.update({f"critic/{k}": v for k, v in critic.call("train_step", samples_ref).items()})
                metrics.update({f"train/{k}": v for k, v in actor.call("train_step", samples_ref).items()})
            if next_rollout is not None:
                with phase(timings, "wait_rollout"):
                    ray.wait([next_rollout], num_returns=1)  # no weight update in the middle of a rollout
            if offload:
                with phase(timings, "onload_rollout"):
                    ray.get(manager.resume_memory.remote())
            with phase(timings, "weight_sync"):
                summary["weight_sync"] = sync_weights(cfg, actor, manager, version=step + 1)
            if offload:
                with phase(timings, "offload_train"):
                    actor.call("offload")
            step += 1
            timings["time/step"] = time.perf_counter() - step_start
            metrics["perf/tokens_per_s"] = sum(len(s.tokens) for s in samples) / timings["time/step"]
            if cfg.eval.prompt_data and cfg.eval.interval and step % cfg.eval.interval == 0:
                last_eval = (step, ray.get(manager.evaluate.remote()))
                metrics.update(last_eval[1])
                notify("eval", {"step": step, "metrics": last_eval[1]})
            if cfg.checkpoint.save_interval and step % cfg.checkpoint.save_interval == 0:
                with phase(timings, "save"):
                    _save(cfg, save_dir, step, actor, critic, manager, run_id)
                last_save = step
            metrics.update(timings)
            logger.log(step, metrics)
            notify("step", {"step": step, "metrics": metrics})
            if exhausted:
                break

        if cfg.eval.prompt_data and last_eval is not None and last_eval[0] != step:
            last_eval = (step, ray.get(manager.evaluate.remote()))
            logger.log(step, last_eval[1])
            notify("eval", {"step": step, "metrics": last_eval[1]})
        if last_eval is not None:
            summary["eval_after"] = last_eval[1]
        if (cfg.checkpoint.save_interval or cfg.checkpoint.save_dir) and last_save != step:
            _save(cfg, save_dir, step, actor, critic, manager, run_id)
        logger.close()
        ray.get(manager.shutdown.remote())
        summary.update(steps=step, elapsed_s=time.perf_counter() - started, metrics_file=str(logger.jsonl_path))
        notify("done", summary)
    return summary


def resolve_cpu_dtype(cfg: Config, resumed_meta: dict[str, Any] | None) -> str | None:
    """Set ``model.dtype: auto`` of a CPU run to what this CPU trains fastest in (core.cpu), or to
    the dtype of the checkpoint a resume continues; returns the line saying which and why. An
    explicit dtype, or a GPU run, is left as it is (None)."""
    if cfg.model.dtype != "auto" or resolve_device(cfg) != "cpu":
        return None
    if resumed_meta is not None:
        # A checkpoint written before auto chose by CPU has no model_dtype: auto then meant fp32 on the CPU.
        cfg.model.dtype = resumed_meta.get("model_dtype") or "float32"
        return f"model.dtype=auto -> {cfg.model.dtype}, as the checkpoint this run resumes was trained"
    info = cpu_info()
    choice = choose_cpu_dtype(info, MatmulShape.of_model(cfg.model.path))
    cfg.model.dtype = choice.dtype
    return f"model.dtype=auto -> {choice.dtype} on {info.describe()}: {choice.reason}"


def _save(cfg: Config, save_dir: Path, step: int, actor: TrainerGroup, critic: TrainerGroup | None,
          manager: Any, run_id: str) -> None:
    import ray

    folder = checkpoint.prepare(save_dir, step)
    actor.call("save", str(folder / "actor"))
    if critic is not None:
        critic.call("save", str(folder / "critic"))
    state = ray.get(manager.state_dict.remote())
    meta = {"rollout_state": state, "run_id": run_id, "model_dtype": cfg.model.dtype}  # dtype: auto resolved
    checkpoint.commit(save_dir, step, meta, keep_last=cfg.checkpoint.keep_last)
