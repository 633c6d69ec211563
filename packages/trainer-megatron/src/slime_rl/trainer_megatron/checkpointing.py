"""MegatronTrainer checkpoints: model, optimizer, LR scheduler, step and RNG with Megatron's
distributed checkpointing (``torch_dist`` format, one file per rank, written in process), so a
resume on another TP/PP/DP layout reshards; a small JSON beside it says what the folder holds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    TorchDistSaveShardedStrategy,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from torch.distributed.checkpoint import FileSystemWriter

from slime_rl.core.infra.safe_pickle import check_dcp_folder, refusals_named
from slime_rl.core.run import disk_full
from slime_rl.trainer_megatron.nonfinite import check_finite_state
from slime_rl.trainer_megatron.optimizer import (
    allocate_state_for_loading,
    hyperparameters,
    is_distributed,
    restore_hyperparameters,
    unshare_loaded_steps,
)

if TYPE_CHECKING:
    from slime_rl.trainer_megatron.trainer import MegatronTrainer

TRAINER_INFO = "slime_rl_trainer.json"
# The distributed optimizer's state saved per parameter in model space (like the plain optimizer's),
# so a resume on another TP/PP/DP layout reshards it; megatron-core's default format (per-rank flat
# ranges, `fully_sharded_model_space`) cannot be written by 0.16's dist_checkpointing at all.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


class DiskFullNamingWriter(FileSystemWriter):
    """torch's synchronous writer, ENOSPC leaving it as `DiskFullError` on the rank that hit it. torch.distributed
    .checkpoint pickles a rank's error to every rank, and its own ("enforce fail ... unexpected pos") holds the
    OSError only in its ``__context__``, which pickling drops: without this no rank of a multi-rank save could
    say "no space" (the driver fell back to how full the disk is, which misses a quota)."""

    def write_data(self, plan, planner):
        with disk_full.named_in(str(self.path)):
            return super().write_data(plan, planner)

    def finish(self, metadata, results) -> None:
        with disk_full.named_in(str(self.path)):
            super().finish(metadata, results)


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
        from torch.distributed.checkpoint import save as dcp_save

        sharded_state_dict, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, True)
        dcp_save(
            mcore_to_pyt_state_dict(sharded_state_dict, False),
            storage_writer=DiskFullNamingWriter(checkpoint_dir, thread_count=1, single_file_per_rank=True),
            planner=MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False),
        )


def sharded_state(trainer: MegatronTrainer, *, loading: bool = False, with_rng: bool = True) -> dict[str, Any]:
    """What a checkpoint holds, as Megatron's sharded state dict of this rank."""
    model_sd = trainer.model.sharded_state_dict()
    state = {
        "model": model_sd,
        # is_loading: a fresh optimizer has no Adam moments yet; Megatron creates them to load into
        "optimizer": trainer.optimizer.sharded_state_dict(model_sd, is_loading=loading, metadata=OPTIMIZER_METADATA),
        "scheduler": trainer.scheduler.state_dict(),
        "step": trainer.step_count,
    }
    if with_rng:  # one RNG state per rank, keyed by global rank
        rng = {"cpu": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
        if trainer.device_type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state()
        rank, world = dist.get_rank(), dist.get_world_size()
        state["rng"] = ShardedObject("rng_state", rng, (world,), (rank,), replica_id=0)
    return state


def save(trainer: MegatronTrainer, path: str) -> None:
    """Write ``trainer``'s state to ``path`` (collective; its weights must be on the device).
    Refuses (NonFiniteError, nothing written) when any weight or optimizer state is nan or inf."""
    check_finite_state(trainer.model, trainer.optimizer, f"checkpoint: refusing to save {path}",
                       "the update of an earlier step made them so; lower trainer.lr or trainer.clip_grad")
    Path(path).mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(sharded_state(trainer), path, sharded_strategy=InProcessTorchDistSave())
    if dist.get_rank() == 0:
        info = {"role": trainer.role, "step": trainer.step_count, "architecture": trainer.shape.architecture,
                "world_size": dist.get_world_size(), "distributed_optimizer": is_distributed(trainer.optimizer)}
        (Path(path) / TRAINER_INFO).write_text(json.dumps(info))
    dist.barrier()


def load(trainer: MegatronTrainer, path: str) -> None:
    """Restore what ``save`` wrote; other TP/PP/DP layouts reshard (RNG streams then start fresh)."""
    info_file = Path(path) / TRAINER_INFO
    if not info_file.is_file():
        raise FileNotFoundError(f"checkpoint: {path} has no {TRAINER_INFO}; it is not a MegatronTrainer checkpoint")
    info = json.loads(info_file.read_text())
    if info["role"] != trainer.role:
        raise ValueError(f"checkpoint: {path} holds a {info['role']}, this trainer is a {trainer.role}")
    saved_sharded = info.get("distributed_optimizer", False)  # checkpoints from before the setting: plain
    if saved_sharded != is_distributed(trainer.optimizer):
        # megatron-core saves the two differently (the distributed one's state has an fp32 "param" per tensor)
        raise ValueError(f"checkpoint: {path} holds a {'distributed' if saved_sharded else 'plain'} optimizer's"
                         f" state; resume with trainer.megatron.use_distributed_optimizer={str(saved_sharded).lower()}")
    same_world = info["world_size"] == dist.get_world_size()
    check_dcp_folder(Path(path))  # every pickle in it is plain data before Megatron unpickles any
    allocate_state_for_loading(trainer.optimizer)
    with refusals_named(path):  # tensor items: torch reads them weights-only; a refusal names the folder
        state = dist_checkpointing.load(sharded_state(trainer, loading=True, with_rng=same_world), path)
    trainer.model.load_state_dict(state["model"])
    built = hyperparameters(trainer.optimizer)
    trainer.optimizer.load_state_dict(state["optimizer"])
    unshare_loaded_steps(trainer.optimizer)
    restore_hyperparameters(trainer.optimizer, built)  # the config's lr, betas, eps; the saved moments
    trainer.scheduler.load_state_dict(state["scheduler"])  # the saved step count, the config's schedule
    trainer.step_count = int(state["step"])
    if same_world:
        rng = state["rng"]
        torch.set_rng_state(rng["cpu"])
        get_cuda_rng_tracker().set_states(rng["tracker"])
        if trainer.device_type == "cuda" and "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"])
    check_finite_state(trainer.model, trainer.optimizer, f"checkpoint: {path}", "resume from an earlier checkpoint")
