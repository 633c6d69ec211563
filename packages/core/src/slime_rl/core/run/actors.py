"""The Ray actors of a run: trainer ranks and the rollout worker.

Both are plain classes wrapped with ``ray.remote`` by the loop, so they can be
tested in process too. A trainer rank owns one `PolicyTrainer` and the step's
`RolloutBatch` shard while it trains on it; the rollout worker hosts the `RolloutEngine`,
the tokenizer, the data source, the buffer and the eval sets, and turns each step's
samples into per-rank shards in the object store (the driver only passes references).
The rollout worker's phase methods and the trainer's step hand the heap memory they freed
back to the OS when they return (`host_memory.trims_after`): colocated, the other process
runs the next phase, and without it the trainer's freed heap grew over a run (the CPU demo's
from 3.2 to 3.8 GiB in 18 steps). The trainer's other calls keep theirs: they allocate little.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import ray
import torch

from slime_rl.core.algorithms import staleness
from slime_rl.core.algorithms.advantages import compute_advantages
from slime_rl.core.algorithms.overlong import apply_overlong
from slime_rl.core.batch import RolloutBatch
from slime_rl.core.config import Config, ConfigError
from slime_rl.core.config.checks import check_algorithm
from slime_rl.core.config.device import resolve_device
from slime_rl.core.contracts import WeightSender
from slime_rl.core.infra.host_memory import trims_after
from slime_rl.core.infra.net import is_loopback, use_interface_of
from slime_rl.core.infra.plugins import load_attr, load_plugin
from slime_rl.core.infra.private_files import keep_files_private
from slime_rl.core.infra.ray_cluster import KeepsInitMistake, keep_init_mistake
from slime_rl.core.roles.endpoints import ENV_ROLES_FILE, ROLES_FILE_NAME
from slime_rl.core.roles.teacher import TeacherScorer
from slime_rl.core.run import disk_full
from slime_rl.core.run.control import ControlEndpoint, NodeWatch, grow_on_new_nodes
from slime_rl.core.run.engine_pool import EnginePool, member_builder
from slime_rl.core.run.fully_async import FullyAsyncRollout
from slime_rl.core.run.metrics import phase
from slime_rl.core.run.rollout import RolloutRunner
from slime_rl.core.sample import Sample
from slime_rl.core.vision.prompt import fill_train_inputs
from slime_rl.core.weights.delta import (
    DeltaEncoder,
    apply_delta_bucket,
    delta_base,
    engine_digests,
    is_delta_bucket,
)
from slime_rl.core.weights.transport import (
    HostArrays,
    from_host_arrays,
    read_bucket_file,
    to_host_arrays,
    write_bucket_file,
)


def _set_threads(cfg: Config) -> None:
    """Ray starts actors with OMP_NUM_THREADS=1 (their num_cpus is 0); on the CPU the phases of a
    synchronous step run one at a time, so each may use every core. SLIME_RL_TORCH_THREADS
    overrides (tests use 1). torch's setting is per thread: async actors call this again from
    their event-loop thread."""
    threads = int(os.environ.get("SLIME_RL_TORCH_THREADS", "0"))
    if not threads and resolve_device(cfg.cluster.device) == "cpu":
        threads = os.cpu_count() or 1
    if threads and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def _cap_onednn_cache() -> None:
    """oneDNN, behind torch's CPU matmuls, keeps up to 1,024 compiled kernels, one per shape. RL
    batches change shape every step: on the demo's batches the trainer kept ~10 MB more a step
    (3 MB with 16, at the same step time). Set before this process's first matmul."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "16")


class TrainerWorker(KeepsInitMistake):
    """One trainer rank. Every call is collective: the loop calls it on all ranks at once. Results
    that the driver reads (timings, metrics) come from rank 0 only; the other ranks return None."""

    @keep_init_mistake
    def __init__(self, cfg_dict: dict[str, Any], *, rank: int, world_size: int, master_addr: str,
                 master_port: int, role: Literal["actor", "critic"] = "actor"):
        keep_files_private()  # checkpoints and weights: the user's alone, whatever the cluster's umask
        cfg = Config.model_validate(cfg_dict)
        check_algorithm(cfg)  # a user's estimator or loss (`module:attr`) must import on this rank too
        # Ray shows an actor only its own GPU: device 0 here, whatever the rank.
        visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        local_rank = 0 if len(visible) == 1 else rank % cfg.cluster.actor_num_gpus_per_node
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank))
        if not is_loopback(master_addr):  # gloo and NCCL on this node's address (core.distributed says why)
            use_interface_of(ray.util.get_node_ip_address())
        _set_threads(cfg)
        _cap_onednn_cache()
        self.rank, self.cfg = rank, cfg
        self.sender: WeightSender | None = None
        # rank 0: the last synced version on the host (delta syncs), or every 64th element (full syncs'
        # change fraction); core/weights/delta.py
        self.delta = (DeltaEncoder(measure_only_every=0 if cfg.rollout.update_weight_mode == "delta" else 64)
                      if rank == 0 else None)
        self.batch: RolloutBatch | None = None  # this rank's shard of the step being trained on
        trainer_cls = load_plugin("slime_rl.trainers", cfg.trainer.backend)
        self.trainer = trainer_cls.from_config(cfg, role=role)

    def ready(self) -> bool:
        self.raise_init_mistake()
        return True

    def _take(self, shard: RolloutBatch) -> RolloutBatch:
        if shard.dp_rank != self.trainer.data_parallel_rank:
            raise ValueError(f"trainer rank {self.rank} is data-parallel rank {self.trainer.data_parallel_rank} but got "
                             f"shard {shard.dp_rank}: the placement plan and the trainer order ranks differently")
        self.batch = shard
        return shard

    def compute_values(self, shard: RolloutBatch) -> torch.Tensor:
        """Critic: values of the shard's response tokens, kept for training and returned for the actor's GAE."""
        batch = self._take(shard)
        batch.values = self.trainer.compute_values(batch)
        return batch.values

    def prepare(self, shard: RolloutBatch, values: torch.Tensor | None = None) -> tuple[dict[str, float] | None,
                                                                                      torch.Tensor | None]:
        """Take this rank's shard and add what the loss needs: old log-probs (a separate pass only
        when the step's updates would move them), reference log-probs for a KL term, and advantages
        (with ``values`` from the critic when the estimator needs one). Returns rank 0's timings and the
        shard's returns (an estimator with a critic: its targets; the loop hands them to the critic rank
        of this shard)."""
        cfg, algo = self.cfg, self.cfg.algorithm
        batch = self._take(shard)
        timings: dict[str, float] = {}
        if cfg.trainer.num_steps_per_rollout > 1 and not algo.use_rollout_logprobs:
            # One optimizer step on-policy needs no pass: the training forward's log-probs are the old policy's.
            with phase(timings, "log_probs"):
                batch.old_log_probs = self.trainer.compute_log_probs(batch, model="actor")
        if algo.use_rollout_logprobs:
            batch.old_log_probs = batch.rollout_log_probs
        if algo.use_kl_loss or algo.kl_coef != 0:
            with phase(timings, "ref_log_probs"):
                batch.ref_log_probs = self.trainer.compute_log_probs(batch, model="ref")
        batch.values = values
        with phase(timings, "advantages"):
            compute_advantages(batch, algo, n_samples_per_prompt=cfg.data.n_samples_per_prompt,
                               sum_over_dp=self.trainer.sum_over_dp)
        return (timings if self.rank == 0 else None), batch.returns

    @trims_after
    def train(self, returns: torch.Tensor | None = None) -> dict[str, float] | None:
        """Train on the prepared shard (a critic gets the actor's ``returns`` for it); rank 0's metrics."""
        if self.batch is None:
            raise RuntimeError("train: no batch; call prepare (actor) or compute_values (critic) first")
        batch, self.batch = self.batch, None
        if returns is not None:
            batch.returns = returns
        metrics = self.trainer.train_step(batch)
        return metrics if self.rank == 0 else None

    def weight_buckets(self, bucket_bytes: int, folder: str | None = None, version: int = 0,
                       engines_hold: int | None = None) -> list[HostArrays] | list[str] | None:
        """All buckets on rank 0 (None elsewhere); every rank takes part in the gather. With
        ``folder`` (the engine runs on this machine), each bucket is a file there instead. Rank 0 sends
        deltas onto ``engines_hold`` when it kept that version (update_weight_mode=delta)."""
        buckets = []
        named = self.trainer.named_weights(bucket_bytes)
        if self.delta is not None:
            named = self.delta.encode(named, version=version, engines_hold=engines_hold)
        for bucket in named:
            if self.rank == 0:
                buckets.append(write_bucket_file(bucket, folder) if folder else to_host_arrays(bucket))
        return buckets if self.rank == 0 else None

    def weight_sync_metrics(self) -> dict[str, float]:
        """The last sync's ``weights/*`` metrics (rank 0; change fraction, bytes moved)."""
        sent = getattr(self.sender, "delta", None)  # an engine's sender that encodes itself (SGLang's)
        if sent is not None:
            return sent.last.metrics()
        return self.delta.last.metrics() if self.delta is not None else {}

    def weight_digest(self) -> tuple[list[str], str] | None:
        """Rank 0, delta mode: the names and digest of the weights the engines should now hold."""
        return self.delta.kept_digest() if self.delta is not None else None

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def process(self) -> tuple[str, int]:
        """(node id, pid): how the driver names this process when a wait on it stalls (infra/stall.py)."""
        return ray.get_runtime_context().get_node_id(), os.getpid()

    def push_weights(self, sender_spec: str, handle: Any, bucket_bytes: int, version: int, transport: str) -> None:
        """Push the weights straight to the engine's servers (the engine's `weight_sender`)."""
        if self.sender is None:
            self.sender = load_attr(sender_spec, what="weight sender")(self.cfg, rank=self.rank)
        named = self.trainer.named_weights(bucket_bytes)
        if self.delta is not None and self.delta.measure_only_every and getattr(self.sender, "delta", None) is None:
            named = self.delta.encode(named, version=version, engines_hold=None)  # full: its change fraction
        self.sender.send(named, handle, version=version, transport=transport)

    def save(self, path: str) -> None:
        with disk_full.named_in(path):  # ENOSPC said as such: torch's error loses it on its way to the driver
            self.trainer.save(path)

    def save_hf(self, path: str) -> None:
        with disk_full.named_in(path):
            self.trainer.save_hf(path)

    def load(self, path: str) -> None:
        self.trainer.load(path)

    def offload(self) -> None:
        self.trainer.offload()

    def onload(self) -> None:
        self.trainer.onload()


@dataclass
class BatchRefs:
    """What the driver gets of a rollout step: object-store references to the step's `RolloutBatch`
    shards and small numbers, never per-token data (the samples, `ScoredGroups`, stay in the rollout
    worker)."""

    shards: list[Any]  # ObjectRef of each data-parallel rank's RolloutBatch shard; [] when it failed or was empty
    metrics: dict[str, float]
    exhausted: bool  # the data ran out
    failure: str | None = None  # why too many samples failed (nothing trains on this step)
    num_samples: int = 0
    num_tokens: int = 0  # prompt + response tokens of the batch
    mean_weight_version: float = 0.0


class RolloutWorker(KeepsInitMistake):
    """Hosts generation: the engine, tokenizer, data source, sample buffer and eval sets. A step's
    rollout is `RolloutRunner.run_step`'s; this turns its samples into the trainer's shards."""

    @keep_init_mistake
    def __init__(self, cfg_dict: dict[str, Any], state_dir: str, log_dir: str | None = None):
        from transformers import AutoTokenizer

        keep_files_private()  # rollouts and rollout state: the user's alone, whatever the cluster's umask
        self.cfg = cfg = Config.model_validate(cfg_dict)
        _set_threads(cfg)
        _cap_onednn_cache()
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path)
        engine_cls = load_plugin("slime_rl.rollout_engines", cfg.rollout.engine)
        self.engine = engine_cls.from_config(cfg)
        if cfg.rollout.elastic.enabled:  # engines join and leave while the run goes (core/run/engine_pool.py)
            self.engine = EnginePool(member_builder(engine_cls, cfg), self.engine,
                                     max_engines=cfg.rollout.elastic.max_engines)
        self.control: ControlEndpoint | None = None
        self._grow: asyncio.Task | None = None  # rollout.elastic.grow_on_new_nodes
        # Vision-language data (docs/vlm.md): an engine that takes images, and the processor that rebuilds the
        # pixel values of samples the buffer stored without them (Sample.multimodal_train_inputs)
        self.processor = None
        if cfg.data.image_key is not None:
            from slime_rl.core.vision.processor import load_processor

            if not getattr(self.engine, "accepts_images", False):
                raise ConfigError("data.image_key", f"rollout.engine {cfg.rollout.engine!r} does not take images; "
                                                    "use hf or sglang, or unset data.image_key for text-only data")
            self.processor = load_processor(cfg.model.tokenizer_path or cfg.model.path)
        source_cls = load_plugin("slime_rl.data_sources", cfg.data.source)
        self.data_source = source_cls.from_config(cfg, tokenizer=self.tokenizer)
        Path(state_dir).mkdir(parents=True, exist_ok=True)
        # Scored groups waiting for training, and groups waiting for (more) generation.
        self.buffer = load_plugin("slime_rl.buffers", cfg.data.buffer).from_config(cfg, state_dir)
        eval_source = load_plugin("slime_rl.data_sources", cfg.eval.source)
        self.eval_sets = {
            name: eval_source.for_eval(cfg, name, tokenizer=self.tokenizer).get_groups(10**9)
            for name in cfg.eval.prompt_data
        }
        self.runner = RolloutRunner(cfg, self.engine, self._decode, self.tokenizer)
        self.fully = (FullyAsyncRollout(cfg, self.runner, self.data_source, lambda: self.engine.weight_version)
                      if cfg.cluster.async_mode == "fully" else None)
        if cfg.roles:  # where the served roles answer, for this process and the reward workers it starts
            os.environ[ENV_ROLES_FILE] = str(Path(state_dir) / ROLES_FILE_NAME)
        self.teacher = TeacherScorer.from_config(cfg, self.tokenizer)  # OPD: None without a teacher

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    @trims_after
    async def run_step(self, step: int) -> BatchRefs:
        """Roll out training step ``step`` (1-based) and put its batch in the object store, one shard
        per data-parallel rank, balanced by tokens; with ``logging.save_rollouts`` its samples go to
        ``rollouts/step_<step>.jsonl`` (a failed step's too, for the record)."""
        _set_threads(self.cfg)
        result = await self.runner.run_step(self.data_source, self.buffer, current_version=self.engine.weight_version)
        samples = [s for g in result.groups for s in g]
        if self.cfg.logging.save_rollouts and self.log_dir is not None and samples:
            _save_rollouts(self.log_dir / "rollouts" / f"step_{step:06d}.jsonl", samples)
        out = BatchRefs([], result.metrics, result.exhausted, result.failure)
        if result.failure is None and samples:
            teacher = await self.teacher.score(samples, out.metrics) if self.teacher is not None else None
            # In a thread: a batch of millions of tokens takes a while, and requests keep being served meanwhile.
            await asyncio.to_thread(self._put_shards, samples, out, self.engine.weight_version, teacher)
        return out

    async def start_fully_async(self) -> None:
        """cluster.async_mode=fully: start generating, and keep generating until shutdown."""
        _set_threads(self.cfg)
        self.fully.start()

    @trims_after
    async def next_batch(self, step: int, current_version: int | None = None) -> BatchRefs:
        """cluster.async_mode=fully: training step ``step``'s batch, once enough groups are eligible
        for the trainer at ``current_version`` (core/fully_async.py); by default the engine's version,
        which is the trainer's: every trained step is synced before the next batch is asked for (a
        failed step trains and syncs nothing, so the step count is no version)."""
        _set_threads(self.cfg)
        if current_version is None:
            current_version = self.engine.weight_version
        result = await self.fully.next_batch(current_version)
        samples = [s for g in result.groups for s in g]
        if self.cfg.logging.save_rollouts and self.log_dir is not None and samples:
            _save_rollouts(self.log_dir / "rollouts" / f"step_{step:06d}.jsonl", samples)
        out = BatchRefs([], result.metrics, result.exhausted, result.failure)
        if result.failure is None and samples:
            teacher = await self.teacher.score(samples, out.metrics) if self.teacher is not None else None
            await asyncio.to_thread(self._put_shards, samples, out, current_version, teacher)
        return out

    def _put_shards(self, samples: list[Sample], out: BatchRefs, current_version: int,
                    teacher: list[list[float]] | None = None) -> None:
        r = self.cfg.rollout
        out.metrics.update(self.engine.stats())
        # Cumulative, so a benchmark can take the engine's busy share of any stretch of steps.
        out.metrics["rollout/engine_busy_total_s"] = self.runner.engine_busy.seconds()
        out.metrics.update(staleness.metrics(samples, current_version))
        weights = staleness.apply_policy(samples, current_version, r.max_staleness, r.staleness_policy)
        # DAPO's overlong filter (truncated samples out of the loss) before the batch counts its tokens
        penalties, overlong_metrics = apply_overlong(samples, self.cfg.algorithm, r.max_response_len,
                                                     self.cfg.global_batch_size)
        out.metrics.update(overlong_metrics)
        if self.processor is not None:
            fill_train_inputs(samples, self.processor)
        batch = RolloutBatch.from_samples(samples, reward_key=self.cfg.rollout.reward_key)
        batch.token_weights = weights
        if teacher is not None:  # OPD: the teacher's log-prob of every response token (core/roles/teacher.py)
            batch.teacher_log_probs = torch.tensor([lp for row in teacher for lp in row], dtype=torch.float32)
        if penalties is not None:  # DAPO's soft overlong punishment, on the reward the advantages read
            batch.rewards = batch.rewards + penalties
        out.shards = [ray.put(shard) for shard in batch.shard(self.cfg.data_parallel_size, self.cfg.global_batch_size)]
        out.num_samples, out.num_tokens = len(batch), len(batch.tokens)
        out.mean_weight_version = float(batch.weight_versions.double().mean())
        out.metrics["perf/batch_tensor_bytes"] = float(batch.tensor_bytes())
        out.metrics["perf/batch_object_bytes"] = float(sum(_object_sizes(out.shards)))

    @trims_after
    async def evaluate(self) -> dict[str, float]:
        _set_threads(self.cfg)
        return await self.runner.evaluate(self.eval_sets)

    @trims_after
    async def update_weights(self, buckets: list[HostArrays] | list[str], version: int) -> None:
        """Buckets from `TrainerWorker.weight_buckets`: arrays, or files this reads and deletes."""
        # Requests in flight (fully async) are held between decode steps while the weights load, and go on
        # with the new ones; an engine that cannot pause is aborted, and its requests resume as partial rollouts.
        paused = await self.engine.pause_generation()
        if not paused and self.fully is not None:
            await self.engine.abort(None)
        try:
            for i, bucket in enumerate(buckets):
                tensors = read_bucket_file(bucket) if isinstance(bucket, str) else from_host_arrays(bucket)
                if is_delta_bucket(tensors) and not self.engine.loads_delta_buckets:
                    tensors = apply_delta_bucket(tensors, self.engine.current_weight,
                                                 held_version=self.engine.weight_version)
                await self.engine.update_weights(tensors, version=version, last=i == len(buckets) - 1)
        finally:
            if paused:
                await self.engine.continue_generation()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def process(self) -> tuple[str, int]:
        """(node id, pid): how the driver names this process when a wait on it stalls (infra/stall.py)."""
        return ray.get_runtime_context().get_node_id(), os.getpid()

    def weight_sender(self) -> str | None:
        return self.engine.weight_sender

    async def weight_digests(self, names: list[str]) -> dict[str, str]:
        """Each serving engine's digest of ``names`` (core/weights/delta.py), for rollout.elastic.verify_weights."""
        return await asyncio.to_thread(engine_digests, self.engine, names)

    def delta_base(self) -> int | None:
        """The version a delta sync may build on: every engine's, when they agree and can take a delta."""
        return delta_base(self.engine)

    async def begin_weight_sync(self, version: int, transport: str) -> Any:
        return await self.engine.begin_weight_sync(version, transport=transport)

    async def end_weight_sync(self, version: int) -> None:
        await self.engine.end_weight_sync(version)

    async def release_memory(self) -> None:
        await self.engine.release_memory()

    async def resume_memory(self, tags: list[str] | None = None) -> None:
        await self.engine.resume_memory(tags)

    def weight_version(self) -> int:
        return self.engine.weight_version

    async def state_dict(self) -> dict[str, Any]:
        # async: runs in the event loop, so the producer (fully async) cannot move between the parts
        state = {"data_source": self.data_source.state_dict(), "buffer": self.buffer.state_dict()}
        if self.fully is not None:
            state["fully_async"] = self.fully.state_dict()
        return state

    async def load_state_dict(self, state: dict[str, Any]) -> None:
        self.data_source.load_state_dict(state["data_source"])
        self.buffer.load_state_dict(state["buffer"])
        if self.fully is not None and "fully_async" in state:
            self.fully.load_state_dict(state["fully_async"])

    async def start_elastic(self) -> str:
        """rollout.elastic.enabled: serve the control endpoint (core/run/control.py) and, with
        grow_on_new_nodes, add an engine for each GPU node Ray reports later. Returns the endpoint's URL."""
        gateway_key = self.cfg.rollout.gateway.api_key
        self.control = ControlEndpoint(self.engine, run_key=gateway_key.reveal() if gateway_key else None,
                                       folder=self.log_dir)
        url = await self.control.start()
        if self.cfg.rollout.elastic.grow_on_new_nodes:
            self._grow = asyncio.get_running_loop().create_task(grow_on_new_nodes(self.engine, NodeWatch(ray.nodes)))
        return url

    async def add_engines(self, count: int) -> list[str]:
        return await self.engine.add_engines(count)

    async def remove_engine(self, name: str) -> int:
        return await self.engine.remove_engine(name)

    async def shutdown(self) -> None:
        if self.control is not None:
            await self.control.stop()
        if self.fully is not None:
            await self.fully.stop()
        await self.engine.shutdown()

    async def ping(self) -> bool:
        self.raise_init_mistake()
        return await asyncio.sleep(0, result=True)


def _save_rollouts(path: Path, samples: list[Sample]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(s.to_dict()) + "\n" for s in samples))


def _object_sizes(refs: list[Any]) -> list[int]:
    """Serialized bytes of objects this process put (Ray's own record of them)."""
    locations = ray.experimental.get_object_locations(refs)
    return [int(locations[ref].get("object_size") or 0) for ref in refs]
