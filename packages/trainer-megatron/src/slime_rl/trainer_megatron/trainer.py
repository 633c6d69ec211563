"""``MegatronTrainer``: one rank of a TP x PP x DP policy (or critic) trainer over megatron-core.

Every rank gets the full list of samples, takes its data-parallel share, runs
Megatron's forward-backward schedule over micro-batches (1F1B under PP), and
returns results identical on every rank: per-token outputs are summed over the
DP group (each sample filled by exactly one rank) and broadcast from the last
pipeline stage.

Loss scaling: the core losses divide by the GLOBAL token and sequence counts of
the optimizer step, so the sum over micro-batches and DP ranks is the whole
batch's loss. Megatron is told not to rescale on top: ``calculate_per_token_loss``
(no division by the number of micro-batches, DDP sums instead of averaging over
DP) and a finalize step that skips the per-token division.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    TorchDistSaveShardedStrategy,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
from megatron.core.transformer.module import Float16Module

from slime_rl.core import losses
from slime_rl.core.config import Config
from slime_rl.core.contracts import NamedTensors, PolicyTrainer
from slime_rl.core.safe_pickle import check_dcp_folder, refusals_named
from slime_rl.core.sample import Sample
from slime_rl.trainer_megatron import batching, convert
from slime_rl.trainer_megatron import device as dev
from slime_rl.trainer_megatron.logprobs import token_log_probs
from slime_rl.trainer_megatron.model import (
    build_model,
    check_parallel_fits,
    hf_model_shape,
    read_hf_config,
    transformer_config,
)
from slime_rl.trainer_megatron.offload import OffloadedStorage, offload_storages, onload_storages

_TRAINER_INFO = "slime_rl_trainer.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class NonFiniteError(FloatingPointError):
    """A loss, gradient or weight that is nan or inf where the trainer refuses one."""


def _finalize_grads_without_token_scaling(model, num_tokens=None, **kwargs):
    """Megatron's grad finalisation (DP all-reduce, tied-embedding sync) minus the division by
    the token count: our losses are already normalised by the global counts."""
    return finalize_model_grads(model, None, **kwargs)


class InProcessTorchDistSave(TorchDistSaveShardedStrategy):
    """Megatron's ``torch_dist`` checkpoint format, written by the calling process.

    Megatron's own torch_dist writer forks one process per file and starts a multiprocessing
    Manager (a spawned interpreter that stays for the rest of the run) to collect their results;
    on the CPU each fork counts the trainer's whole memory again while it writes. This writes
    the same files (torch.distributed.checkpoint's format with Megatron's planner, one file per
    rank) with torch's synchronous FileSystemWriter, so ``dist_checkpointing.load`` reads them
    as it reads any torch_dist checkpoint. (A subclass of Megatron's strategy: megatron-core
    0.19 replaces any other save strategy with its own.)"""

    def __init__(self):
        super().__init__("torch_dist", 1)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def save(self, sharded_state_dict, checkpoint_dir) -> None:
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint import save as dcp_save

        sharded_state_dict, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, True)
        dcp_save(
            mcore_to_pyt_state_dict(sharded_state_dict, False),
            storage_writer=FileSystemWriter(checkpoint_dir, thread_count=1, single_file_per_rank=True),
            planner=MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False),
        )


class MegatronTrainer(PolicyTrainer):
    """See the module docstring. Build with ``MegatronTrainer.from_config(cfg, role=...)``."""

    @classmethod
    def from_config(cls, cfg: Config, *, role: Literal["actor", "critic"] = "actor") -> MegatronTrainer:
        return cls(cfg, role=role)

    def __init__(self, cfg: Config, *, role: Literal["actor", "critic"] = "actor"):
        if role not in ("actor", "critic"):
            raise ValueError(f"role: {role!r}; use 'actor' or 'critic'")
        self.cfg, self.role = cfg, role
        self._setup_parallel()
        self.dtype = self._resolve_dtype(cfg.model.dtype)
        self.hf_config = read_hf_config(cfg.model.path)
        self.shape = hf_model_shape(self.hf_config)
        module = self._build_model()
        self._ref_weights = self._load_weights()  # host copy of the reference, when one is needed
        self._swap_spare: dict[str, torch.Tensor] = {}
        self.ddp = DistributedDataParallel(
            config=self.tconfig,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
            ),
            module=module,
        )
        self.tconfig.no_sync_func = self.ddp.no_sync
        self.tconfig.finalize_model_grads_func = _finalize_grads_without_token_scaling
        self.optimizer, self.scheduler = self._build_optimizer()
        self.step_count = 0
        self._forward_backward = get_forward_backward_func()
        self._offloaded: list[OffloadedStorage] = []

    # ---------------------------------------------------------------- setup helpers

    def _setup_parallel(self) -> None:
        """Device, process group and Megatron's TP/PP/DP groups; seeds."""
        cfg = self.cfg
        self.device_type = dev.resolve_device(cfg.cluster.device)
        if self.device_type == "cpu":
            dev.redirect_megatron_to_cpu()
        dev.init_distributed(self.device_type)
        self.device = dev.current_device(self.device_type)
        tp, pp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
        world = dist.get_world_size()
        if world % (tp * pp):
            raise ValueError(f"parallel: TP * PP = {tp * pp} must divide the {world} trainer ranks")
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        elif (parallel_state.get_tensor_model_parallel_world_size(),
              parallel_state.get_pipeline_model_parallel_world_size()) != (tp, pp):
            raise RuntimeError("parallel: this process already initialised Megatron with another TP/PP layout")
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.is_last_stage = parallel_state.is_pipeline_last_stage()
        # Same seed on every rank: dropout masks (if any) depend only on the seed, not on the layout.
        torch.manual_seed(cfg.trainer.seed)
        model_parallel_cuda_manual_seed(cfg.trainer.seed)

    def _build_model(self) -> torch.nn.Module:
        """This rank's stage of the model, on its device; returns the module DDP wraps."""
        p = self.cfg.parallel
        tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
        check_parallel_fits(self.shape, tp, pp)
        self.tconfig = transformer_config(
            self.shape, tp=tp, pp=pp, dtype=self.dtype, recompute=self.cfg.trainer.recompute,
            sequence_parallel=p.sequence_parallel, compiled_fusions=self.device_type == "cuda",
        )
        self.model = build_model(self.shape, self.tconfig, self.hf_config, value_head=self.role == "critic")
        if self.device_type == "cuda":
            self.model.cuda()
        # bf16: Float16Module also casts the torch norms' fp32 weights, so every parameter has its
        # final dtype before weights are loaded or snapshotted.
        return Float16Module(self.tconfig, self.model) if self.dtype != torch.float32 else self.model

    def _load_weights(self) -> dict[str, torch.Tensor] | None:
        """The HF weights into the model; returns a host copy of the reference weights (model.ref_path,
        else the initial ones) when a KL term or an explicit reference asks for them."""
        cfg, algo = self.cfg, self.cfg.algorithm
        needs_ref = self.role == "actor" and (algo.use_kl_loss or algo.kl_coef != 0 or cfg.model.ref_path is not None)
        ref = None
        if needs_ref and cfg.model.ref_path not in (None, cfg.model.path):
            convert.load_hf(self.model, cfg.model.ref_path, self.shape)
            ref = self._snapshot_to_host()
        convert.load_hf(self.model, cfg.model.path, self.shape)
        if needs_ref and ref is None:
            ref = self._snapshot_to_host()
        return ref

    def _build_optimizer(self) -> tuple[Any, OptimizerParamScheduler]:
        t = self.cfg.trainer
        lr = (t.critic_lr or t.lr) if self.role == "critic" else t.lr
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=lr, min_lr=t.min_lr, weight_decay=t.weight_decay,
                adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_eps=t.adam_eps, clip_grad=t.clip_grad,
                bf16=self.dtype == torch.bfloat16, fp16=self.dtype == torch.float16, params_dtype=self.dtype,
                use_distributed_optimizer=False,
            ),
            [self.ddp],
        )
        # Without TransformerEngine/Apex, Megatron builds torch's AdamW; its fused kernel (CPU and
        # CUDA) makes one pass over each tensor instead of a chain of elementwise ops.
        for inner in _torch_optimizers(optimizer):
            if isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
                for group in inner.param_groups:
                    group["fused"], group["foreach"] = True, False
        return optimizer, self._make_scheduler(optimizer, lr)

    def _resolve_dtype(self, name: str) -> torch.dtype:
        if name == "auto":
            return torch.bfloat16 if self.device_type == "cuda" else torch.float32
        if name == "float16" and self.device_type == "cpu":
            raise ValueError("model.dtype: float16 on the CPU is not supported; use float32, bfloat16 or auto")
        return _DTYPES[name]

    def _make_scheduler(self, optimizer, lr: float) -> OptimizerParamScheduler:
        t, d = self.cfg.trainer, self.cfg.data
        warmup = t.lr_warmup_steps
        if t.lr_decay_style == "constant":
            total = warmup + 1
        else:
            if d.num_rollout is None:
                raise ValueError(
                    f"trainer.lr_decay_style: {t.lr_decay_style} needs the total number of optimizer steps;"
                    " set data.num_rollout"
                )
            total = d.num_rollout * t.num_steps_per_rollout
            if total <= warmup:
                raise ValueError(f"trainer.lr_warmup_steps: {warmup} must be below the {total} optimizer steps")
        return OptimizerParamScheduler(
            optimizer, init_lr=0.0 if warmup else lr, max_lr=lr, min_lr=t.min_lr,
            lr_warmup_steps=warmup, lr_decay_steps=total, lr_decay_style=t.lr_decay_style,
            start_wd=t.weight_decay, end_wd=t.weight_decay, wd_incr_steps=total, wd_incr_style="constant",
        )

    # ---------------------------------------------------------------- micro-batching

    def _my_micro_batches(self, samples: list[Sample]) -> list[batching.MicroBatch]:
        batching.check_samples(samples)
        if len(samples) < self.dp_size:
            raise ValueError(
                f"got {len(samples)} samples for data-parallel size {self.dp_size}; every DP rank needs at least one"
            )
        ids = batching.dp_shard(samples, self.dp_rank, self.dp_size)
        t = self.cfg.trainer
        return batching.micro_batches(
            samples, ids, micro_batch_size=t.micro_batch_size, max_tokens=t.max_tokens_per_gpu, device=self.device
        )

    def _run(self, mbs: list[batching.MicroBatch], loss_func, *, forward_only: bool) -> list[Any]:
        """Megatron's schedule over ``mbs``; ``loss_func(mb, hidden) -> (loss, outputs)``.
        Returns the ``outputs`` of each micro-batch on the last stage ([] elsewhere)."""
        fp16_kwargs = {"fp32_output": False} if self.dtype != torch.float32 else {}

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            hidden = model(mb.input_ids, None, None, packed_seq_params=mb.packed, **fp16_kwargs)

            def on_last_stage(output):
                loss, outputs = loss_func(mb, output)
                return loss, torch.ones((), dtype=torch.int), outputs

            return hidden, on_last_stage

        longest = max(mb.input_ids.shape[1] for mb in mbs)
        widest = max(mb.input_ids.shape[0] for mb in mbs)
        return self._forward_backward(
            forward_step_func=forward_step, data_iterator=iter(mbs), model=[self.ddp], num_microbatches=len(mbs),
            seq_length=longest, micro_batch_size=widest, decoder_seq_length=longest, forward_only=forward_only,
        )

    def _hidden_rows(self, mb: batching.MicroBatch, hidden: torch.Tensor) -> torch.Tensor:
        """The hidden states that predict the response tokens, ``[N, h]``."""
        return hidden.reshape(-1, hidden.shape[-1]).index_select(0, mb.hidden_index)

    def _temperature(self) -> float:
        if self.cfg.algorithm.loss_type == "sft":
            return 1.0
        temperature = self.cfg.rollout.temperature
        if temperature <= 0:
            raise ValueError("rollout.temperature: 0 (greedy) has no log-probs to train on; use a temperature > 0")
        return temperature

    # ---------------------------------------------------------------- results to every rank

    def _share_per_token(self, samples: list[Sample], per_mb: list[tuple[list[int], torch.Tensor]]) -> list[list[float]]:
        """Per-token values of this rank's micro-batches -> every sample's list, on every rank."""
        offsets = [0, *itertools.accumulate(s.response_length for s in samples)]
        flat = torch.zeros(offsets[-1], dtype=torch.float32, device=self.device)
        for sample_ids, values in per_mb:
            pos = 0
            for i in sample_ids:
                r = samples[i].response_length
                flat[offsets[i] : offsets[i] + r] = values[pos : pos + r]
                pos += r
        if self.dp_size > 1:  # each sample is filled by exactly one DP rank: the sum is exact
            dist.all_reduce(flat, group=parallel_state.get_data_parallel_group())
        self._broadcast_from_last_stage(flat)
        values = flat.cpu().tolist()
        return [values[offsets[i] : offsets[i + 1]] for i in range(len(samples))]

    def _broadcast_from_last_stage(self, tensor: torch.Tensor) -> None:
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        if pp > 1:
            group = parallel_state.get_pipeline_model_parallel_group()
            dist.broadcast(tensor, src=parallel_state.get_pipeline_model_parallel_last_rank(), group=group)

    def _share_metrics(self, parts: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        local = losses.reduce_metrics(parts) if parts else {}
        if self.dp_size > 1:
            gathered: list[dict[str, float] | None] = [None] * self.dp_size
            dist.all_gather_object(gathered, local, group=parallel_state.get_data_parallel_group())
            local = losses.reduce_metrics([g for g in gathered if g])
        box = [local]
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast_object_list(
                box, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                group=parallel_state.get_pipeline_model_parallel_group(),
            )
        return box[0]

    # ---------------------------------------------------------------- log-probs and values

    @torch.no_grad()
    def compute_log_probs(self, samples: list[Sample], *, model: Literal["actor", "ref"] = "actor") -> list[list[float]]:
        if self.role != "actor":
            raise ValueError("compute_log_probs: this trainer is a critic; use compute_values")
        if model not in ("actor", "ref"):
            raise ValueError(f"compute_log_probs: model={model!r}; use 'actor' or 'ref'")
        if not samples:
            return []
        temperature = self._temperature()
        mbs = self._my_micro_batches(samples)

        def loss_func(mb, hidden):
            logp, _ = token_log_probs(
                self._hidden_rows(mb, hidden), self.model.output_weight(), mb.targets, temperature=temperature
            )
            return hidden.new_zeros(()), {"values": logp}

        self.ddp.eval()
        with self._weights(model):
            outputs = self._run(mbs, loss_func, forward_only=True)
        self.ddp.train()
        per_mb = [(mb.sample_ids, out["values"]) for mb, out in zip(mbs, outputs, strict=True)] if self.is_last_stage else []
        return self._share_per_token(samples, per_mb)

    @torch.no_grad()
    def compute_values(self, samples: list[Sample]) -> list[list[float]]:
        if self.role != "critic":
            raise NotImplementedError("compute_values: this trainer is an actor (build it with role='critic')")
        if not samples:
            return []
        mbs = self._my_micro_batches(samples)

        def loss_func(mb, hidden):
            return hidden.new_zeros(()), {"values": self._values(mb, hidden).float()}

        self.ddp.eval()
        outputs = self._run(mbs, loss_func, forward_only=True)
        self.ddp.train()
        per_mb = [(mb.sample_ids, out["values"]) for mb, out in zip(mbs, outputs, strict=True)] if self.is_last_stage else []
        return self._share_per_token(samples, per_mb)

    def _values(self, mb: batching.MicroBatch, hidden: torch.Tensor) -> torch.Tensor:
        rows = self._hidden_rows(mb, hidden)
        return self.model.value_head(rows.to(self.model.value_head.weight.dtype)).squeeze(-1)

    # ---------------------------------------------------------------- training

    def train_step(self, samples: list[Sample]) -> dict[str, float]:
        """Optimizer steps over ``samples``, ``global_batch_size`` samples each (one step when they
        fit; the loop hands over a whole rollout, ``num_steps_per_rollout`` steps' worth). Metrics are
        averaged over the steps (``*_max``/``*_min``: the extreme); ``lr`` is the last step's."""
        if not samples:
            raise ValueError("train_step: got no samples")
        size = self.cfg.global_batch_size
        steps = [self._optimizer_step(samples[k : k + size]) for k in range(0, len(samples), size)]
        if len(steps) == 1:
            return steps[0]
        combine = {"max": max, "min": min, "sum": lambda xs: sum(xs) / len(xs)}
        out = {name: combine[losses.metric_reduction(name)]([m[name] for m in steps]) for name in steps[0]}
        out.update(lr=steps[-1]["lr"], optimizer_steps=float(len(steps)),
                   nonfinite_skipped=sum(m["nonfinite_skipped"] for m in steps))
        return out

    def _optimizer_step(self, samples: list[Sample]) -> dict[str, float]:
        algo = self.cfg.algorithm
        mbs = self._my_micro_batches(samples)
        # Global counts of this optimizer step: every rank holds every sample.
        num_tokens = float(sum(sum(s.loss_mask) if s.loss_mask else s.response_length for s in samples))
        num_seqs = float(len(samples))
        if num_tokens == 0:
            raise ValueError("train_step: every loss_mask is 0; there is nothing to train on")
        temperature = 1.0 if self.role == "critic" else self._temperature()
        eps_clip_high = self.cfg.eps_clip_high
        want_entropy_grad = algo.entropy_coef != 0 and algo.loss_type != "sft"

        def field(mb, name):
            return batching.padded_field(samples, mb, name, device=self.device)

        def loss_mask(mb):
            mask = field(mb, "loss_mask")
            return mask if mask is not None else mb.response_mask.float().to(self.device)

        def actor_loss(mb, hidden):
            logp, entropy = token_log_probs(
                self._hidden_rows(mb, hidden), self.model.output_weight(), mb.targets,
                temperature=temperature, with_entropy=algo.loss_type != "sft",
            )
            log_probs = batching.scatter_padded(logp, mb)
            mask = loss_mask(mb)
            if algo.loss_type == "sft":
                batch = losses.LossBatch(log_probs=log_probs, old_log_probs=log_probs.detach(),
                                         advantages=torch.zeros_like(mask), loss_mask=mask)
            else:
                advantages = field(mb, "advantages")
                if advantages is None:
                    raise ValueError("train_step: samples need advantages (one per response token)")
                rollout = field(mb, "rollout_log_probs")
                old = rollout if algo.use_rollout_logprobs else field(mb, "old_log_probs")
                if old is None:  # on-policy single step: the ratio is 1 at the current weights
                    old = log_probs.detach()
                ent = batching.scatter_padded(entropy if want_entropy_grad else entropy.detach(), mb)
                batch = losses.LossBatch(
                    log_probs=log_probs, old_log_probs=old, advantages=advantages, loss_mask=mask,
                    rollout_log_probs=rollout, ref_log_probs=field(mb, "ref_log_probs"), entropy=ent,
                )
            return losses.compute_loss(algo, batch, eps_clip_high=eps_clip_high, num_tokens=num_tokens,
                                       num_seqs=num_seqs)

        def critic_loss(mb, hidden):
            values = batching.scatter_padded(self._values(mb, hidden).float(), mb)
            old_values, returns = field(mb, "values"), field(mb, "returns")
            if old_values is None or returns is None:
                raise ValueError("train_step (critic): samples need values and returns (one per response token)")
            loss, metrics = losses.value_loss(
                values, old_values, returns, loss_mask(mb), value_clip=algo.value_clip, loss_agg=algo.loss_agg,
                num_tokens=num_tokens, num_seqs=num_seqs,
            )
            return loss, {**metrics, "loss": loss.detach()}

        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = self._run(mbs, critic_loss if self.role == "critic" else actor_loss, forward_only=False)
        lr = self.optimizer.param_groups[0]["lr"]
        metrics = self._share_metrics(outputs if self.is_last_stage else [])  # the same on every rank
        bad = self._nonfinite_step(metrics["loss"])
        if bad is None:
            update_ok, grad_norm, _ = self.optimizer.step()
            self.scheduler.step(increment=1)
            self.step_count += 1
        else:  # Megatron's fp32/bf16 optimizers would apply it (only fp16's loss scaler checks)
            if self.cfg.trainer.on_nonfinite == "stop":
                raise NonFiniteError(
                    f"trainer.on_nonfinite=stop: optimizer step {self.step_count + 1} ({self.role}) has a non-finite"
                    f" {bad}; the update was not applied. Look for inf/nan in the rewards and advantages or lower"
                    " trainer.lr; trainer.on_nonfinite=skip skips such steps instead")
            # Skipped as a whole: weights, Adam moments and the LR schedule stay where they were.
            update_ok, grad_norm = False, None
        metrics.update(grad_norm=float(grad_norm) if grad_norm is not None else float("nan"), lr=float(lr),
                       update_skipped=float(not update_ok), nonfinite_skipped=float(bad is not None))
        return metrics

    def _nonfinite_step(self, loss: float) -> str | None:
        """What makes this step's update non-finite (``"loss (nan)"``, ``"gradient"``), or None.
        The same answer on every rank: the loss is shared and the gradient check all-reduced."""
        if not math.isfinite(loss):
            return f"loss ({loss})"
        if self.dtype == torch.float16:  # Megatron's loss scaler skips inf/nan gradients and lowers the scale
            return None
        grads = [g for p in self.model.parameters() if (g := getattr(p, "main_grad", None)) is not None]
        finite = torch.stack([_finite(g) for g in grads]).all() if grads else torch.tensor(True)
        finite = finite.to(device=self.device, dtype=torch.int32)
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)  # a DP or TP/PP peer may hold the bad shard
        return None if finite.item() else "gradient"

    # ---------------------------------------------------------------- weights out

    def named_weights(self, bucket_bytes: int) -> Iterator[NamedTensors]:
        return convert.bucketed(convert.iter_hf_tensors(self.model, self.shape), bucket_bytes)

    def save_hf(self, folder: str) -> None:
        """Write the current weights as an HF folder (collective; rank 0 writes)."""
        hf_dtype = getattr(self.hf_config, "dtype", None) or getattr(self.hf_config, "torch_dtype", None)
        if isinstance(hf_dtype, str):
            hf_dtype = _DTYPES.get(hf_dtype)
        convert.save_hf(self.model, self.shape, self.cfg.model.path, folder, dtype=hf_dtype)

    # ---------------------------------------------------------------- reference weights

    def _snapshot_to_host(self) -> dict[str, torch.Tensor]:
        return {name: _host_copy(p.detach()) for name, p in self.model.named_parameters()}

    @contextlib.contextmanager
    def _weights(self, which: Literal["actor", "ref"]):
        """Run with the reference weights swapped in (and the actor's swapped back after)."""
        if which == "actor":
            yield
            return
        if self._ref_weights is None:
            raise ValueError(
                "compute_log_probs(model='ref'): no reference weights kept; set algorithm.use_kl_loss,"
                " algorithm.kl_coef or model.ref_path"
            )
        self._swap_ref()
        try:
            yield
        finally:
            self._swap_ref()

    @torch.no_grad()
    def _swap_ref(self) -> None:
        """Exchange the model's weights with the host-held ones (the reference, or the actor's)."""
        for name, param in self.model.named_parameters():
            held = self._ref_weights[name]
            # Same dtype only: a dtype change would give the parameter a new grad accumulator and
            # silently detach Megatron's DDP gradient hook from it.
            assert held.dtype == param.dtype and held.shape == param.shape, name
            if not param.is_cuda:  # host memory already: exchange storage, no copy
                param.data, self._ref_weights[name] = held, param.data
                continue
            spare = self._swap_spare.get(name)  # a second pinned buffer, made on the first swap
            if spare is None:
                spare = self._swap_spare[name] = torch.empty(held.shape, dtype=held.dtype, pin_memory=True)
            spare.copy_(param.data, non_blocking=True)
            param.data.copy_(held, non_blocking=True)
            self._ref_weights[name], self._swap_spare[name] = spare, held
        if self.device_type == "cuda":
            torch.cuda.synchronize()

    # ---------------------------------------------------------------- checkpoints

    def _sharded_state(self, *, loading: bool = False, with_rng: bool = True) -> dict[str, Any]:
        model_sd = self.model.sharded_state_dict()
        state = {
            "model": model_sd,
            # is_loading: a fresh optimizer has no Adam moments yet; Megatron creates them to load into
            "optimizer": self.optimizer.sharded_state_dict(model_sd, is_loading=loading),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step_count,
        }
        if with_rng:  # one RNG state per rank, keyed by global rank
            rng = {"cpu": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
            if self.device_type == "cuda":
                rng["cuda"] = torch.cuda.get_rng_state()
            rank, world = dist.get_rank(), dist.get_world_size()
            state["rng"] = ShardedObject("rng_state", rng, (world,), (rank,), replica_id=0)
        return state

    def save(self, path: str) -> None:
        """Model, optimizer, LR scheduler and RNG with Megatron's distributed checkpointing (collective).
        Refuses (NonFiniteError, nothing written) when any weight or optimizer state is nan or inf."""
        with self._onloaded():  # the loop saves after the trainer handed its GPU memory over
            self._check_finite(f"checkpoint: refusing to save {path}", "the update of an earlier step made them so;"
                               " lower trainer.lr or trainer.clip_grad")
            Path(path).mkdir(parents=True, exist_ok=True)
            dist.barrier()
            dist_checkpointing.save(self._sharded_state(), path, sharded_strategy=InProcessTorchDistSave())
        if dist.get_rank() == 0:
            info = {"role": self.role, "step": self.step_count, "architecture": self.shape.architecture,
                    "world_size": dist.get_world_size()}
            (Path(path) / _TRAINER_INFO).write_text(json.dumps(info))
        dist.barrier()

    def load(self, path: str) -> None:
        """Restore what ``save`` wrote; other TP/PP/DP layouts reshard (RNG streams then start fresh)."""
        info_file = Path(path) / _TRAINER_INFO
        if not info_file.is_file():
            raise FileNotFoundError(f"checkpoint: {path} has no {_TRAINER_INFO}; it is not a MegatronTrainer checkpoint")
        info = json.loads(info_file.read_text())
        if info["role"] != self.role:
            raise ValueError(f"checkpoint: {path} holds a {info['role']}, this trainer is a {self.role}")
        same_world = info["world_size"] == dist.get_world_size()
        check_dcp_folder(Path(path))  # every pickle in it is plain data before Megatron unpickles any
        with refusals_named(path):  # tensor items: torch reads them weights-only; a refusal names the folder
            state = dist_checkpointing.load(self._sharded_state(loading=True, with_rng=same_world), path)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step_count = int(state["step"])
        if same_world:
            rng = state["rng"]
            torch.set_rng_state(rng["cpu"])
            get_cuda_rng_tracker().set_states(rng["tracker"])
            if self.device_type == "cuda" and "cuda" in rng:
                torch.cuda.set_rng_state(rng["cuda"])
        self._check_finite(f"checkpoint: {path}", "resume from an earlier checkpoint")

    def _check_finite(self, what: str, fix: str) -> None:
        """NonFiniteError on every rank when any rank's weights or optimizer state hold a nan or inf."""
        tensors = itertools.chain(self.model.named_parameters(),
                                  (("optimizer state", t) for t in _optimizer_tensors(self.optimizer)))
        local = next((name for name, t in tensors if t.is_floating_point() and not _finite(t)), None)
        found: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(found, local)  # every rank decides alike: a collective save follows
        bad = [f"{name} (rank {rank})" for rank, name in enumerate(found) if name is not None]
        if bad:
            raise NonFiniteError(f"{what}: nan or inf in {', '.join(bad[:3])}; {fix}")

    # ---------------------------------------------------------------- colocation

    def offload(self) -> None:
        """Weights, optimizer state and gradient buffers off the GPU (CUDA; a no-op on the CPU).
        Storages move, not tensors (see offload.py): Megatron's gradient hooks stay attached."""
        if self.device_type != "cuda" or self._offloaded:
            return
        kept = [t for t in (*self.model.parameters(), *_optimizer_tensors(self.optimizer)) if t.is_cuda]
        grads = [g for p in self.model.parameters() if (g := getattr(p, "main_grad", None)) is not None and g.is_cuda]
        self._offloaded = offload_storages(kept) + offload_storages(grads, keep=False)
        torch.cuda.empty_cache()

    def onload(self) -> None:
        """Bring back what ``offload`` moved."""
        onload_storages(self._offloaded)
        self._offloaded = []

    @contextlib.contextmanager
    def _onloaded(self) -> Iterator[None]:
        """On the GPU for the duration, offloaded again after if it was: offloaded storages hold no
        bytes on the device, and reading them (a save does) would read freed memory."""
        was_offloaded = bool(self._offloaded)
        if was_offloaded:
            self.onload()
        try:
            yield
        finally:
            if was_offloaded:
                self.offload()


def _finite(t: torch.Tensor) -> torch.Tensor:
    """Whether ``t`` holds no nan or inf, as a 0-d bool tensor on its device. min and max propagate
    nan: one pass without a bool copy (``isfinite(t).all()`` took 30x longer on a 135M-value CPU tensor)."""
    if t.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=t.device)
    low, high = torch.aminmax(t)
    return torch.isfinite(low) & torch.isfinite(high)


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A host copy of ``t``, in pinned memory when ``t`` is on the GPU (fast transfers back)."""
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
    out.copy_(t)
    return out


def _optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """The parameters the torch optimizers step (fp32 main copies under bf16) and their state."""
    tensors = []
    for inner in _torch_optimizers(optimizer):
        tensors += [p for group in inner.param_groups for p in group["params"]]
        tensors += [v for state in inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def _torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a Megatron (possibly chained) optimizer."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return [inner for opt in chained for inner in _torch_optimizers(opt)]
    inner = getattr(optimizer, "optimizer", None)
    return [inner] if isinstance(inner, torch.optim.Optimizer) else []
