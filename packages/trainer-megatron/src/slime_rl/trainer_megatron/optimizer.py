"""The trainer's optimizer (Megatron's, over torch's fused Adam) and its LR schedule."""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from slime_rl.core.config import Config


def build_optimizer(cfg: Config, ddp: DistributedDataParallel, *, lr: float,
                    dtype: torch.dtype) -> tuple[Any, OptimizerParamScheduler]:
    """Adam over ``ddp``'s parameters (fp32 main weights under bf16/fp16) and its LR scheduler; sharded over
    the data-parallel ranks (Megatron's distributed optimizer) when ``ddp`` was built for it
    (trainer.megatron.use_distributed_optimizer: the gradient buffers and the optimizer must agree)."""
    t = cfg.trainer
    if ddp.ddp_config.use_distributed_optimizer:
        _load_moments_around_the_step()
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=lr, min_lr=t.min_lr, weight_decay=t.weight_decay,
            adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_eps=t.adam_eps, clip_grad=t.clip_grad,
            bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
            use_distributed_optimizer=ddp.ddp_config.use_distributed_optimizer,
        ),
        [ddp],
    )
    # Without TransformerEngine/Apex, Megatron builds torch's AdamW; its fused kernel (CPU and
    # CUDA) makes one pass over each tensor instead of a chain of elementwise ops.
    for inner in torch_optimizers(optimizer):
        if isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            for group in inner.param_groups:
                group["fused"], group["foreach"] = True, False
    return optimizer, make_scheduler(cfg, optimizer, lr)


def make_scheduler(cfg: Config, optimizer, lr: float) -> OptimizerParamScheduler:
    t, d = cfg.trainer, cfg.data
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
        # A resume keeps the checkpoint's step count but this config's schedule (docs/reliability.md#resume):
        # Megatron's default restores the saved lr, min_lr, warmup and decay over the user's new ones.
        override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=False,
    )


def hyperparameters(optimizer) -> list[dict[str, Any]]:
    """Each param group's settings but its parameters (lr, max_lr, min_lr, betas, eps, weight decay):
    what the config built, to put back over a loaded checkpoint's (`restore_hyperparameters`)."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def restore_hyperparameters(optimizer, built: list[dict[str, Any]]) -> None:
    """Put the config's group settings back after ``optimizer.load_state_dict``, which restores the
    saved ones with Adam's moments: a resume with a new trainer.lr or adam_beta2 trains with it."""
    groups = optimizer.param_groups
    if len(groups) != len(built):  # the same model and config build the same groups
        raise ValueError(f"checkpoint: {len(groups)} optimizer param groups loaded, {len(built)} built;"
                         " resume with the model and trainer.lora the checkpoint was written with")
    for group, settings in zip(groups, built, strict=True):
        group.update(settings)


def is_distributed(optimizer) -> bool:
    """Whether ``optimizer`` (possibly chained) is Megatron's distributed optimizer."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(opt, DistributedOptimizer) for opt in getattr(optimizer, "chained_optimizers", [optimizer]))


def allocate_state_for_loading(optimizer) -> None:
    """Give a fresh distributed optimizer's Adam a state (zero moments, step 0) for a checkpoint to load
    into. Without TransformerEngine or Apex, megatron-core's `DistributedOptimizer.state_dict` reads
    each parameter's ``step``, which a torch Adam that has not stepped yet lacks (an assert); the plain
    optimizer builds its state itself (its ``init_state_fn``)."""
    if not is_distributed(optimizer):
        return
    for inner in torch_optimizers(optimizer):
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state[p]:
                    # fused Adam keeps its step on the parameter's device
                    step_device = p.device if group.get("fused") or group.get("capturable") else "cpu"
                    inner.state[p] = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p),
                                      "step": torch.zeros((), dtype=torch.float32, device=step_device)}


def unshare_loaded_steps(optimizer) -> None:
    """After a load, one ``step`` tensor per parameter: megatron-core's distributed optimizer puts a
    single tensor in every parameter's state, and torch's fused Adam adds 1 to each parameter's step
    in place, so a shared one would count every parameter's increment."""
    for inner in torch_optimizers(optimizer):
        for state in inner.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def _load_moments_around_the_step() -> None:
    """megatron-core's load of a ``fully_reshardable`` distributed-optimizer checkpoint copies every key of
    a parameter's Adam state from the checkpoint, but it skips ``step`` (torch Adam's own key, which only
    exists without TransformerEngine/Apex) on the way in: a KeyError. The step comes from the param
    groups (set just before); this hands it over as the value to copy."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    copy_states = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(copy_states, "keeps_step", False):
        return

    def copy_states_keeping_step(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            step = self.optimizer.state[main_param].get("step")
            if step is not None:
                tensors = {**tensors, "step": step}
        copy_states(self, model_param, tensors)

    copy_states_keeping_step.keeps_step = True
    DistributedOptimizer._set_main_param_and_optimizer_states = copy_states_keeping_step


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """The parameters the torch optimizers step (fp32 main copies under bf16) and their state."""
    tensors = []
    for inner in torch_optimizers(optimizer):
        tensors += [p for group in inner.param_groups for p in group["params"]]
        tensors += [v for state in inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a Megatron (possibly chained) optimizer."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return [inner for opt in chained for inner in torch_optimizers(opt)]
    inner = getattr(optimizer, "optimizer", None)
    return [inner] if isinstance(inner, torch.optim.Optimizer) else []
