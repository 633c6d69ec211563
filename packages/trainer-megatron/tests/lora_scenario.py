"""The LoRA scenario of a trainer test (one rank of launch(), or in-process at TP=1): adapters at the
start, three steps with the adapters' gradients after each, the base weights before and after, actor
and reference log-probs, a PEFT folder and the merged model saved, and a resume after step 1."""

from __future__ import annotations

from pathlib import Path

import torch


def reduced_grad_buffers(trainer) -> None:
    """With the distributed optimizer each rank holds the data-parallel sum of its own shard of every
    gradient bucket only (reduce-scatter): gather the shards so that every ``main_grad`` is the sum."""
    if not trainer.ddp.ddp_config.use_distributed_optimizer:
        return
    for group in trainer.ddp.bucket_groups + trainer.ddp.expert_parallel_bucket_groups:
        ranks, rank = group.intra_distributed_optimizer_instance_size, group.intra_distributed_optimizer_instance_rank
        for bucket in group.buckets:
            shard = bucket.grad_data.numel() // ranks
            mine = bucket.grad_data[rank * shard:(rank + 1) * shard].clone()
            torch.distributed.all_gather_into_tensor(bucket.grad_data, mine,
                                                     group=group.intra_distributed_optimizer_instance_group)


def adapter_grads(trainer) -> dict[str, torch.Tensor]:
    """Every adapter's A and B gradient, whole (gathered over TP, collected over PP), on every rank."""
    from slime_rl.trainer_megatron import lora

    reduced_grad_buffers(trainer)
    mine = {}
    for layer, adapter in trainer.adapters.layers:
        a_ref, b_ref = adapter._refs()
        for which, param, ref in (("A", adapter.lora_A, a_ref), ("B", adapter.lora_B, b_ref)):
            mine[f"{layer}.{adapter.proj.path}.{which}"] = lora._gather(ref, param.main_grad.float()).cpu()
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, mine)
    return {k: v for part in gathered for k, v in part.items()}


def run_lora(spec: dict) -> dict:
    from megatron_testlib import make_config, make_samples
    from megatron_worker import shard_for, whole_step

    from slime_rl.trainer_megatron import convert
    from slime_rl.trainer_megatron.trainer import MegatronTrainer

    torch.set_num_threads(1)
    cfg = make_config(Path(spec["model"]), spec.get("overrides", []))
    samples = make_samples(spec["num_samples"], spec["vocab"], seed=spec.get("seed", 1))
    trainer = MegatronTrainer.from_config(cfg)
    batch = shard_for(trainer, samples)

    def synced():  # what named_weights sends (the adapters, or merged weights per rollout.lora_sync)
        return {n: t.cpu().clone() for b in trainer.named_weights(1 << 16) for n, t in b}

    def base(t):
        return {n: w.cpu().clone() for n, w in convert.iter_hf_tensors(t.model, t.shape)}

    result: dict = {"adapters_init": synced(), "trainable": sorted(
        n for n, p in trainer.model.named_parameters() if p.requires_grad)}
    result["optimized_params"] = sum(p.numel() for g in trainer.optimizer.param_groups for p in g["params"])
    base_before = base(trainer)
    log_probs = trainer.compute_log_probs(batch)
    result["log_probs"], _ = whole_step(batch, log_probs)
    batch.old_log_probs = log_probs
    batch.ref_log_probs = trainer.compute_log_probs(batch, model="ref")
    result["ref_log_probs_init"], _ = whole_step(batch, batch.ref_log_probs)

    steps, save_after = spec.get("steps", 3), spec.get("save_after")
    result["metrics"], result["grads"], result["adapters"] = [], [], []
    for k in range(steps):
        if save_after is not None and k == save_after:
            trainer.save(spec["ckpt"])
        result["metrics"].append(trainer.train_step(batch))
        result["grads"].append(adapter_grads(trainer))
        result["adapters"].append(synced())
    result["base_unchanged"] = all(torch.equal(w, base_before[n]) for n, w in base(trainer).items())
    result["trained_log_probs"], _ = whole_step(batch, trainer.compute_log_probs(batch))
    result["ref_log_probs"], _ = whole_step(batch, trainer.compute_log_probs(batch, model="ref"))
    trainer.cfg.rollout.lora_sync = "merged"  # what a merged sync sends
    result["merged"] = synced()
    trainer.cfg.rollout.lora_sync = "adapter"
    if spec.get("save_hf"):
        trainer.save_hf(spec["save_hf"])

    if save_after is not None:
        del trainer
        trainer = MegatronTrainer.from_config(cfg)
        trainer.load(spec["ckpt"])
        result["resumed_metrics"] = [trainer.train_step(batch) for _ in range(save_after, steps)]
        result["resumed_adapters"] = synced()
    return result
