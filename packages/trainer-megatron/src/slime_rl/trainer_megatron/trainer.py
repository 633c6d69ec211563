"""``MegatronTrainer``: one rank of a TP x CP x PP x DP policy (or critic) trainer over megatron-core.

Each rank gets its data-parallel rank's shard of the step (`RolloutBatch.shard`; the TP, CP and PP
peers of one DP rank get the same shard; CP ranks each hold two chunks of every sequence), runs Megatron's forward-backward schedule over
micro-batches of it (1F1B under PP), and returns per-token results for the shard's samples,
broadcast from the last pipeline stage so every rank of the shard holds them. Nothing per token
crosses the data-parallel group; metrics (a few scalars) are reduced over it.

Loss scaling: the core losses divide by the GLOBAL token and sequence counts of the optimizer
step (``RolloutBatch.optimizer_steps``: over all shards), so the sum over micro-batches and DP
ranks is the whole batch's loss. Megatron is told not to rescale on top:
``calculate_per_token_loss`` (no division by the number of micro-batches, DDP sums instead of
averaging over DP) and a finalize step that skips the per-token division.

Homes of the parts: batching.py (micro-batches), optimizer.py (Adam and the LR schedule), reference.py (the
reference weights), nonfinite.py (no nan or inf reaches the weights), checkpointing.py (save and load), lora.py
(``trainer.lora``: adapters, the base frozen; the reference is then the base with the adapters off),
context_parallel.py (``parallel.context_parallel_size``), sequence_parallel.py (``parallel.sequence_parallel``:
SP-aware norms, micro-batches padded for TP), vlm.py (Qwen2.5-VL: images, mRoPE, the vision tower frozen or not).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Literal

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.module import Float16Module

from slime_rl.core.algorithms import losses
from slime_rl.core.algorithms.lora import lora_spec, syncs_adapters
from slime_rl.core.batch import ROLLOUT_OPTIONAL_COLUMNS, TRAINER_COLUMNS, RolloutBatch
from slime_rl.core.config import Config
from slime_rl.core.config.dtype import model_dtype
from slime_rl.core.contracts import NamedTensors, PolicyTrainer
from slime_rl.trainer_megatron import batching, checkpointing, convert, lora, moe, sequence_parallel, vlm
from slime_rl.trainer_megatron import device as dev
from slime_rl.trainer_megatron.context_parallel import gather_tokens
from slime_rl.trainer_megatron.logprobs import token_log_probs
from slime_rl.trainer_megatron.model import (
    attention_cost_weight,
    build_model,
    check_parallel_fits,
    hf_model_shape,
    read_hf_config,
    transformer_config,
)
from slime_rl.trainer_megatron.nonfinite import NonFiniteError, nonfinite_update
from slime_rl.trainer_megatron.offload import OffloadedStorage, offload_storages, onload_storages
from slime_rl.trainer_megatron.optimizer import build_optimizer, optimizer_tensors
from slime_rl.trainer_megatron.reference import ReferenceWeights, load_policy_and_reference
from slime_rl.trainer_megatron.settings import MegatronSettings, megatron_settings

__all__ = ["MegatronTrainer", "NonFiniteError"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(setting: str, device_type: str) -> torch.dtype:
    """``model.dtype`` as the trainer builds in it: core's one rule for every backend (config/dtype.py)."""
    name = model_dtype(setting, device_type)
    if name == "float16" and device_type == "cpu":
        raise ValueError("model.dtype: float16 on the CPU is not supported; use float32, bfloat16 or auto")
    return _DTYPES[name]


def _finalize_grads_without_token_scaling(model, num_tokens=None, **kwargs):
    """Megatron's grad finalisation (DP all-reduce, tied-embedding sync) minus the division by
    the token count: our losses are already normalised by the global counts."""
    return finalize_model_grads(model, None, **kwargs)


class MegatronTrainer(PolicyTrainer):
    """See the module docstring. Build with ``MegatronTrainer.from_config(cfg, role=...)``."""

    settings = MegatronSettings  # trainer.megatron (settings.py, also the entry point the config loader reads)

    @classmethod
    def from_config(cls, cfg: Config, *, role: Literal["actor", "critic"] = "actor") -> MegatronTrainer:
        return cls(cfg, role=role)

    def __init__(self, cfg: Config, *, role: Literal["actor", "critic"] = "actor"):
        if role not in ("actor", "critic"):
            raise ValueError(f"role: {role!r}; use 'actor' or 'critic'")
        self.cfg, self.role = cfg, role
        self._setup_parallel()
        self.dtype = torch_dtype(cfg.model.dtype, self.device_type)
        self.hf_config = read_hf_config(cfg.model.path)
        self.shape = hf_model_shape(self.hf_config)
        module = self._build_model()
        self.reference: ReferenceWeights | lora.Adapters | None
        if self.adapters is not None:  # the reference is the base: the adapters switched off, no copy
            convert.load_hf(self.model, cfg.model.path, self.shape)
            self.reference = self.adapters
        else:  # a host copy of the reference, when a KL term or an explicit reference needs one
            self.reference = load_policy_and_reference(self.model, cfg, self.shape, role=role)
        self.ddp = DistributedDataParallel(
            config=self.tconfig,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                use_distributed_optimizer=self._shards_optimizer(),
            ),
            module=module,
        )
        self.tconfig.no_sync_func = self.ddp.no_sync
        self.tconfig.finalize_model_grads_func = _finalize_grads_without_token_scaling
        t = cfg.trainer
        lr = (t.critic_lr or t.lr) if role == "critic" else t.lr
        self.optimizer, self.scheduler = build_optimizer(cfg, self.ddp, lr=lr, dtype=self.dtype)
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
        ep, etp = cfg.parallel.expert_model_parallel_size, cfg.parallel.expert_tensor_parallel_size
        cp = cfg.parallel.context_parallel_size
        world = dist.get_world_size()
        if cp > 1 and cfg.trainer.max_tokens_per_gpu is None:
            raise ValueError("parallel.context_parallel_size: > 1 splits packed sequences; set"
                             " trainer.max_tokens_per_gpu (tokens per CP rank)")
        if world % (tp * pp * cp):
            raise ValueError(f"parallel: TP * CP * PP = {tp * cp * pp} must divide the {world} trainer ranks")
        if world % (ep * etp * pp):
            raise ValueError(f"parallel: EP * ETP * PP = {ep * etp * pp} must divide the {world} trainer ranks")
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                                     expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                                                     context_parallel_size=cp)
        elif (parallel_state.get_tensor_model_parallel_world_size(),
              parallel_state.get_pipeline_model_parallel_world_size(),
              parallel_state.get_expert_model_parallel_world_size(),
              parallel_state.get_expert_tensor_parallel_world_size(),
              parallel_state.get_context_parallel_world_size()) != (tp, pp, ep, etp, cp):
            raise RuntimeError("parallel: this process already initialised Megatron with another TP/PP/EP/CP layout")
        self.cp_size, self.cp_rank = cp, parallel_state.get_context_parallel_rank()
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
        check_parallel_fits(self.shape, tp, pp, p.context_parallel_size)
        ep, etp = p.expert_model_parallel_size, p.expert_tensor_parallel_size
        moe.check_expert_parallel(self.shape.moe, tp=tp, ep=ep, etp=etp, sequence_parallel=p.sequence_parallel)
        sequence_parallel.check_supported(tp=tp if p.sequence_parallel else 1, cp=p.context_parallel_size,
                                          lora=lora_spec(self.cfg) is not None)
        if self.cfg.algorithm.routing_replay == "rollout" and self.shape.moe is None:
            raise ValueError(f"algorithm.routing_replay: rollout needs a mixture-of-experts model; {self.cfg.model.path}"
                             f" is {self.shape.architecture} (set routing_replay to off)")
        t, mt = self.cfg.trainer, megatron_settings(self.cfg)
        moe_fields = None
        if self.shape.moe is not None:
            moe.patch_megatron_without_te()
            moe_fields = moe.transformer_config_fields(
                self.shape.moe, ep=ep, etp=etp, aux_loss_coeff=mt.moe_aux_loss_coeff, z_loss_coeff=mt.moe_z_loss_coeff,
                load_balancing_type=mt.moe_router_load_balancing_type,
                routing_replay=self.cfg.algorithm.routing_replay == "rollout")
        self.tconfig = transformer_config(
            self.shape, tp=tp, pp=pp, dtype=self.dtype, recompute=mt.recompute,
            sequence_parallel=p.sequence_parallel, compiled_fusions=self.device_type == "cuda", moe_fields=moe_fields,
            packed_attention=mt.packed_attention, context_parallel_size=p.context_parallel_size,
        )
        self.model = build_model(self.shape, self.tconfig, self.hf_config, value_head=self.role == "critic",
                                 grouped_experts=mt.moe_grouped_gemm)
        moe.reduce_expert_grads_over_tp(self.model, tp=tp, etp=etp)
        vlm.configure(self.model, self.shape, self.cfg)  # a VL model's layout checks and trainer.freeze_vision_tower
        self.adapters: lora.Adapters | None = None
        if (spec := lora_spec(self.cfg)) is not None:  # before DDP: it wraps the trainable parameters only
            lora.check_supported(spec, self.shape, self.role)
            self.adapters = lora.Adapters(self.model, spec, self.shape, t.seed)
        self.router_stats = moe.RouterStats(self.model) if self.shape.moe is not None else None
        self.routing_replay = None
        if moe_fields is not None and moe_fields["moe_enable_routing_replay"]:
            if mt.recompute:
                raise ValueError("algorithm.routing_replay: rollout does not support trainer.megatron.recompute yet (the"
                                 " recomputed forward would need the replayed experts again); set recompute to false")
            self.routing_replay = moe.RoutingReplay(self.model)
        if self.device_type == "cuda":
            self.model.cuda()
        # bf16: Float16Module also casts the torch norms' fp32 weights, so every parameter has its
        # final dtype before weights are loaded or snapshotted.
        return Float16Module(self.tconfig, self.model) if self.dtype != torch.float32 else self.model

    def _shards_optimizer(self) -> bool:
        """``trainer.megatron.use_distributed_optimizer``, but not for embeddings tied across pipeline stages
        under TP > 1, which megatron-core's distributed optimizer resumes wrongly (TP2 x PP2, tied: the resumed
        steps' ratios diverge; untied, or TP or PP alone, resume bit for bit). On one DP rank it shards
        nothing but keeps the checkpoint format, so a DP=2 run's checkpoint still loads into one rank."""
        if not megatron_settings(self.cfg).use_distributed_optimizer:
            return False
        p = self.cfg.parallel
        if self.shape.tie_word_embeddings and p.tensor_model_parallel_size > 1 and p.pipeline_model_parallel_size > 1:
            if dist.get_rank() == 0:
                print("trainer.megatron.use_distributed_optimizer: off for this layout (embeddings tied across"
                      " pipeline stages under tensor parallelism do not resume correctly with it)", flush=True)
            return False
        return True

    # ---------------------------------------------------------------- data parallelism

    @property
    def data_parallel_rank(self) -> int:
        return self.dp_rank

    def sum_over_dp(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the data-parallel group (a new tensor, on ``tensor``'s device and
        dtype); ``tensor`` itself with one DP rank. The collective runs on this trainer's device
        (gloo takes CPU tensors, NCCL CUDA ones)."""
        if self.dp_size == 1:
            return tensor
        total = tensor.detach().to(self.device, copy=True)
        dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
        return total.to(device=tensor.device, dtype=tensor.dtype)

    def _check_shard(self, batch: RolloutBatch, what: str) -> None:
        if batch.dp_rank != self.dp_rank:
            raise ValueError(
                f"{what}: got the shard of data-parallel rank {batch.dp_rank} on DP rank {self.dp_rank};"
                " hand each rank batch.shard(dp_size, samples_per_step)[trainer.data_parallel_rank]"
            )
        batching.check_batch(batch)
        for name in ("loss_mask", "rollout_log_probs", *TRAINER_COLUMNS, *ROLLOUT_OPTIONAL_COLUMNS):
            column = getattr(batch, name)
            if column is not None and len(column) != batch.num_response_tokens:
                raise ValueError(f"{what}: batch.{name} has {len(column)} entries for the shard's"
                                 f" {batch.num_response_tokens} response tokens")

    # ---------------------------------------------------------------- micro-batching

    def _micro_batches(self, batch: RolloutBatch) -> list[batching.MicroBatch]:
        t = self.cfg.trainer
        same_count = None
        if self.cfg.parallel.expert_model_parallel_size > 1:
            same_count = self._most_micro_batches
        mbs = batching.micro_batches(batch, micro_batch_size=t.micro_batch_size, max_tokens=t.max_tokens_per_gpu,
                                     device=self.device, count_at_least=same_count,
                                     attention_weight=attention_cost_weight(self.shape),
                                     context_parallel=(self.cp_size, self.cp_rank))
        if self.tconfig.sequence_parallel:  # each TP rank holds 1/TP of every micro-batch's sequence
            tp = self.cfg.parallel.tensor_model_parallel_size
            rank = parallel_state.get_tensor_model_parallel_rank()
            mbs = [sequence_parallel.pad_micro_batch(mb, tp, rank) for mb in mbs]
        return vlm.with_vision_inputs(mbs, batch, self.shape, self.device)

    def _most_micro_batches(self, count: int) -> int:
        """The most micro-batches any data-parallel rank has (expert-parallel groups lie within it)."""
        most = torch.tensor([count], device=self.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=parallel_state.get_data_parallel_group())
        return int(most)

    def _run(self, mbs: list[batching.MicroBatch], loss_func, *, forward_only: bool) -> list[Any]:
        """Megatron's schedule over ``mbs``; ``loss_func(mb, hidden) -> (loss, outputs)``.
        Returns the ``outputs`` of each micro-batch on the last stage ([] elsewhere)."""
        fp16 = {"fp32_output": False} if self.dtype != torch.float32 else {}

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            if self.routing_replay is not None:
                self.routing_replay.use(mb.routed_experts, self.device)
            if self.router_stats is not None:
                self.router_stats.real_tokens = mb.sp_real_tokens
            hidden = model(mb.input_ids, mb.position_ids, None, packed_seq_params=mb.packed, **mb.model_inputs, **fp16)

            def on_last_stage(output):
                loss, outputs = loss_func(mb, output)
                return loss, torch.ones((), dtype=torch.int), outputs

            return hidden, on_last_stage

        longest = max(mb.input_ids.shape[1] for mb in mbs)
        widest = max(mb.input_ids.shape[0] for mb in mbs)
        try:
            return self._forward_backward(
                forward_step_func=forward_step, data_iterator=iter(mbs), model=[self.ddp], num_microbatches=len(mbs),
                seq_length=longest, micro_batch_size=widest, decoder_seq_length=longest, forward_only=forward_only,
            )
        finally:
            if self.routing_replay is not None:
                self.routing_replay.clear()

    def _hidden_rows(self, mb: batching.MicroBatch, hidden: torch.Tensor) -> torch.Tensor:
        """The hidden states that predict the response tokens, ``[N, h]``."""
        if self.tconfig.sequence_parallel:
            hidden = sequence_parallel.gather_hidden(hidden)
        return hidden.reshape(-1, hidden.shape[-1]).index_select(0, mb.hidden_index)

    def _temperature(self) -> float:
        if self.cfg.algorithm.loss_type == "sft":
            return 1.0
        temperature = self.cfg.rollout.temperature
        if temperature <= 0:
            raise ValueError("rollout.temperature: 0 (greedy) has no log-probs to train on; use a temperature > 0")
        return temperature

    # ---------------------------------------------------------------- results to every rank of the shard

    def _per_token(self, batch: RolloutBatch, mbs: list[batching.MicroBatch], outputs: list[Any]) -> torch.Tensor:
        """The last stage's per-micro-batch ``values`` -> ``[num_response_tokens]`` float32 on the CPU, in
        the shard's order, on every rank of the shard (TP ranks computed the same; PP gets a broadcast)."""
        flat = torch.zeros(batch.num_response_tokens, dtype=torch.float32, device=self.device)
        if self.is_last_stage:
            index = torch.cat([mb.response_index for mb in mbs]).to(self.device)
            flat[index] = torch.cat([out["values"] for out in outputs]).float()
        self._broadcast_from_last_stage(flat)
        return flat.cpu()

    def _broadcast_from_last_stage(self, tensor: torch.Tensor) -> None:
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        if pp > 1:
            group = parallel_state.get_pipeline_model_parallel_group()
            dist.broadcast(tensor, src=parallel_state.get_pipeline_model_parallel_last_rank(), group=group)

    def _share_metrics(self, parts: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        local = losses.reduce_metrics(parts, final=self.dp_size == 1) if parts else {}  # final: *_dist -> quantiles
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
    def compute_log_probs(self, batch: RolloutBatch, *, model: Literal["actor", "ref"] = "actor") -> torch.Tensor:
        """One log-prob per response token of this rank's shard, ``[batch.num_response_tokens]`` float32 (CPU)."""
        if self.role != "actor":
            raise ValueError("compute_log_probs: this trainer is a critic; use compute_values")
        if model not in ("actor", "ref"):
            raise ValueError(f"compute_log_probs: model={model!r}; use 'actor' or 'ref'")
        self._check_shard(batch, "compute_log_probs")
        if len(batch) == 0:
            return torch.zeros(0, dtype=torch.float32)
        temperature = self._temperature()
        mbs = self._micro_batches(batch)

        def loss_func(mb, hidden):
            logp, _ = token_log_probs(
                self._hidden_rows(mb, hidden), self.model.output_weight(), mb.targets, temperature=temperature
            )
            return hidden.new_zeros(()), {"values": gather_tokens(logp, mb.cp_gather)}

        self.ddp.eval()
        with self._weights(model):
            outputs = self._run(mbs, loss_func, forward_only=True)
        self.ddp.train()
        return self._per_token(batch, mbs, outputs)

    @torch.no_grad()
    def compute_values(self, batch: RolloutBatch) -> torch.Tensor:
        """Critic values, one per response token of this rank's shard (float32, CPU)."""
        if self.role != "critic":
            raise NotImplementedError("compute_values: this trainer is an actor (build it with role='critic')")
        self._check_shard(batch, "compute_values")
        if len(batch) == 0:
            return torch.zeros(0, dtype=torch.float32)
        mbs = self._micro_batches(batch)

        def loss_func(mb, hidden):
            return hidden.new_zeros(()), {"values": self._values(mb, hidden).float()}

        self.ddp.eval()
        outputs = self._run(mbs, loss_func, forward_only=True)
        self.ddp.train()
        return self._per_token(batch, mbs, outputs)

    def _values(self, mb: batching.MicroBatch, hidden: torch.Tensor) -> torch.Tensor:
        rows = self._hidden_rows(mb, hidden)
        values = self.model.value_head(rows.to(self.model.value_head.weight.dtype)).squeeze(-1)
        return gather_tokens(values, mb.cp_gather)  # context parallelism: the micro-batch's, on every CP rank

    # ---------------------------------------------------------------- training

    def train_step(self, batch: RolloutBatch) -> dict[str, float]:
        """One optimizer step per ``batch.optimizer_steps()`` entry (the loop hands over a whole
        rollout, ``num_steps_per_rollout`` steps' worth). Metrics are averaged over the steps
        (``*_max``/``*_min``: the extreme); ``lr`` is the last step's."""
        self._check_shard(batch, "train_step")
        if len(batch) == 0:
            raise ValueError("train_step: got an empty shard")
        self._check_loss_inputs(batch)
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        steps = [self._optimizer_step(part, num_tokens, num_seqs) for part, num_tokens, num_seqs
                 in batch.optimizer_steps()]
        if len(steps) == 1:
            out = steps[0]
        else:
            combine = {"max": max, "min": min, "sum": lambda xs: sum(xs) / len(xs)}
            out = {name: combine[losses.metric_reduction(name)]([m[name] for m in steps]) for name in steps[0]}
            out.update(lr=steps[-1]["lr"], optimizer_steps=float(len(steps)),
                       nonfinite_skipped=sum(m["nonfinite_skipped"] for m in steps))
        if cuda:  # this rank's allocator peak over the update: what long samples and micro-batch budgets cost
            out["peak_memory_gib_max"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return out

    def _check_loss_inputs(self, batch: RolloutBatch) -> None:
        if self.role == "critic":
            if batch.values is None or batch.returns is None:
                raise ValueError("train_step (critic): the batch needs values (compute_values) and returns"
                                 " (compute_advantages with an estimator that needs a critic, e.g. ppo)")
        elif self.cfg.algorithm.loss_type != "sft" and batch.advantages is None:
            raise ValueError("train_step: the batch needs advantages (one per response token; compute_advantages)")

    def _optimizer_step(self, part: RolloutBatch, num_tokens: float, num_seqs: int) -> dict[str, float]:
        """One optimizer step on ``part`` (this rank's samples of it); the losses divide by the step's
        ``num_tokens`` (loss tokens) and ``num_seqs`` (samples) over all data-parallel ranks."""
        algo = self.cfg.algorithm
        if len(part) == 0:
            raise ValueError(f"train_step: optimizer step {self.step_count + 1} has no samples on data-parallel rank"
                             f" {self.dp_rank}; build the shards with RolloutBatch.shard")
        if num_tokens == 0:
            raise ValueError("train_step: every loss_mask is 0; there is nothing to train on")
        mbs = self._micro_batches(part)
        num_tokens, num_seqs = float(num_tokens), float(num_seqs)
        temperature = 1.0 if self.role == "critic" else self._temperature()
        eps_clip_high = self.cfg.eps_clip_high
        want_entropy_grad = algo.entropy_coef != 0 and algo.loss_type != "sft"

        def field(mb, column):
            return batching.padded_field(column, mb, device=self.device)

        def actor_loss(mb, hidden):
            logp, entropy = token_log_probs(
                self._hidden_rows(mb, hidden), self.model.output_weight(), mb.targets,
                temperature=temperature, with_entropy=algo.loss_type != "sft",
            )
            logp, entropy = gather_tokens(logp, mb.cp_gather), gather_tokens(entropy, mb.cp_gather)
            log_probs = batching.scatter_padded(logp, mb)
            mask = field(mb, part.loss_mask)
            if part.token_weights is not None:  # staleness_policy=downweight: stale tokens count less (the
                mask = mask * field(mb, part.token_weights)  # denominators keep counting whole tokens)
            if algo.loss_type == "sft":
                inputs = losses.LossBatch(log_probs=log_probs, old_log_probs=log_probs.detach(),
                                          advantages=torch.zeros_like(mask), loss_mask=mask)
            else:
                rollout = field(mb, part.rollout_log_probs)
                old = rollout if algo.use_rollout_logprobs else field(mb, part.old_log_probs)
                if old is None:  # on-policy single step: the ratio is 1 at the current weights
                    old = log_probs.detach()
                ent = batching.scatter_padded(entropy if want_entropy_grad else entropy.detach(), mb)
                inputs = losses.LossBatch(
                    log_probs=log_probs, old_log_probs=old, advantages=field(mb, part.advantages), loss_mask=mask,
                    rollout_log_probs=rollout, ref_log_probs=field(mb, part.ref_log_probs), entropy=ent,
                )
            return losses.compute_loss(algo, inputs, eps_clip_high=eps_clip_high, num_tokens=num_tokens,
                                       num_seqs=num_seqs)

        def critic_loss(mb, hidden):
            values = batching.scatter_padded(self._values(mb, hidden).float(), mb)
            loss, metrics = losses.value_loss(
                values, field(mb, part.values), field(mb, part.returns), field(mb, part.loss_mask),
                value_clip=algo.value_clip, loss_agg=algo.loss_agg, num_tokens=num_tokens, num_seqs=num_seqs,
            )
            return loss, {**metrics, "loss": loss.detach()}

        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.router_stats is not None:
            self.router_stats.reset()
        outputs = self._run(mbs, critic_loss if self.role == "critic" else actor_loss, forward_only=False)
        lr = self.optimizer.param_groups[0]["lr"]
        metrics = self._share_metrics(outputs if self.is_last_stage else [])  # the same on every rank
        if self.router_stats is not None:
            # (TP ranks too: under SP each routes its share of the tokens; max / mean ignores duplicates)
            metrics.update(self.router_stats.take(
                parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)))
        if self.routing_replay is not None:  # 1.0: every micro-batch ran on the engine's experts
            metrics["moe_routing_replayed"] = float(all(mb.routed_experts is not None for mb in mbs))
        bad = nonfinite_update(metrics["loss"], self.model, self.dtype, self.device)
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

    # ---------------------------------------------------------------- weights out

    def named_weights(self, bucket_bytes: int) -> Iterator[NamedTensors]:
        if self.adapters is None:
            tensors = convert.iter_hf_tensors(self.model, self.shape)
        elif syncs_adapters(self.cfg):
            tensors = self.adapters.peft_tensors()
        else:
            tensors = self.adapters.merged_hf_tensors()
        return convert.bucketed(tensors, bucket_bytes)

    def save_hf(self, folder: str) -> None:
        """Write the current weights as an HF folder (collective; rank 0 writes). With LoRA: a PEFT
        adapter folder, and with ``checkpoint.save_hf_merged`` the merged model in ``<folder>/merged``."""
        hf_dtype = getattr(self.hf_config, "dtype", None) or getattr(self.hf_config, "torch_dtype", None)
        if isinstance(hf_dtype, str):
            hf_dtype = _DTYPES.get(hf_dtype)
        with self._onloaded():  # the loop saves after the trainer handed its GPU memory over
            if self.adapters is None:
                convert.save_hf(self.model, self.shape, self.cfg.model.path, folder, dtype=hf_dtype)
                return
            self.adapters.save_peft(folder, self.cfg.model.path)
            if self.cfg.checkpoint.save_hf_merged:
                convert.save_hf(self.model, self.shape, self.cfg.model.path, f"{folder}/merged", dtype=hf_dtype,
                                tensors=self.adapters.merged_hf_tensors())

    # ---------------------------------------------------------------- reference weights

    @contextlib.contextmanager
    def _weights(self, which: Literal["actor", "ref"]) -> Iterator[None]:
        """Run with the reference weights swapped in (and the actor's swapped back after)."""
        if which == "actor":
            yield
            return
        if self.reference is None:
            raise ValueError(
                "compute_log_probs(model='ref'): no reference weights kept; set algorithm.use_kl_loss,"
                " algorithm.kl_coef or model.ref_path"
            )
        with self.reference.swapped_in():
            yield

    # ---------------------------------------------------------------- checkpoints

    def save(self, path: str) -> None:
        """Model, optimizer, LR scheduler and RNG with Megatron's distributed checkpointing (collective).
        Refuses (NonFiniteError, nothing written) when any weight or optimizer state is nan or inf."""
        with self._onloaded():  # the loop saves after the trainer handed its GPU memory over
            checkpointing.save(self, path)

    def load(self, path: str) -> None:
        """Restore what ``save`` wrote; other TP/PP/DP layouts reshard (RNG streams then start fresh)."""
        checkpointing.load(self, path)

    # ---------------------------------------------------------------- colocation

    def offload(self) -> None:
        """Weights, optimizer state and gradient buffers off the GPU (CUDA; a no-op on the CPU).
        Storages move, not tensors (see offload.py): Megatron's gradient hooks stay attached."""
        if self.device_type != "cuda" or self._offloaded:
            return
        kept = [t for t in (*self.model.parameters(), *optimizer_tensors(self.optimizer)) if t.is_cuda]
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
