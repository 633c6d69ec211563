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
    """Adam over ``ddp``'s parameters (fp32 main weights under bf16/fp16) and its LR scheduler."""
    t = cfg.trainer
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=lr, min_lr=t.min_lr, weight_decay=t.weight_decay,
            adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_eps=t.adam_eps, clip_grad=t.clip_grad,
            bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
            use_distributed_optimizer=False,
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
