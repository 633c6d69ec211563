"""One rank of a multi-rank trainer test (launched by megatron_testlib.launch), or the same
scenario in-process at TP=1 (``run_scenario``), so both sides run identical code.

Scenario: build the trainer, take this rank's shard of the samples, export its weights (HF
round trip), sum over the data-parallel ranks and compute GRPO advantages on the shards,
compute actor and reference log-probs, train ``steps`` steps (saving a checkpoint after ``save_after``
steps when asked), then resume a fresh trainer from that checkpoint and redo the
remaining steps.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch


def shard_for(trainer, samples: list):
    """This rank's shard of ``samples``, cut into optimizer steps of the config's global batch size."""
    from megatron_testlib import to_batch

    return to_batch(samples, dp_size=trainer.dp_size, dp_rank=trainer.data_parallel_rank,
                    samples_per_step=trainer.cfg.global_batch_size)


def whole_step(batch, per_token: torch.Tensor) -> tuple[list[list[float]], bool]:
    """Every shard's per-token result put back in step order (``positions``), one list per sample,
    and whether the ranks that hold the same shard (TP/PP peers) hold the same values."""
    from megatron_testlib import per_sample

    mine = (batch.positions.tolist(), per_sample(batch, per_token))
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, mine)
    step: list = [None] * batch.step_size
    peers_agree = True
    for positions, rows in gathered:
        for position, row in zip(positions, rows, strict=True):
            peers_agree &= step[position] is None or step[position] == row
            step[position] = row
    assert all(row is not None for row in step), "the shards do not cover the step"
    return step, peers_agree


def shortened(sample, prompt: int, response: int):
    """``sample`` cut to ``prompt`` prompt and ``response`` response tokens (its per-token fields too)."""
    keep = len(sample.tokens) - sample.response_length
    tokens = sample.tokens[: min(prompt, keep)] + sample.tokens[keep : keep + response]
    return dataclasses.replace(sample, tokens=tokens, response_length=response, loss_mask=[1] * response,
                               rollout_log_probs=sample.rollout_log_probs[:response],
                               advantages=sample.advantages[:response])


def scatter(batch) -> torch.Tensor:
    """A fixed offset per response token, a function of its sample's index and its position only (the same
    on any layout): +-0.4 around 0, and 0.8 more on every sample whose index is 2 mod 3."""
    sample = batch.sample_ids.repeat_interleave(batch.response_lengths)
    position = torch.cat([torch.arange(n) for n in batch.response_lengths.tolist()])
    return (0.4 * torch.sin(12.9898 * sample + 78.233 * position) + 0.8 * (sample % 3 == 2)).float()


def local_expert_count(model: torch.nn.Module) -> int:
    """Experts held by this rank, over its layers: SequentialMLP's one module each, or the leading
    dimension of the grouped experts' stacked weight."""
    count = 0
    for name, param in model.named_parameters():
        if name.endswith("experts.fc2_weight"):
            count += param.shape[0]
        elif ".local_experts." in name and name.endswith("linear_fc2.weight"):
            count += 1
    return count


def run_scenario(spec: dict) -> dict:
    from megatron_testlib import make_config, make_samples

    from slime_rl.core.algorithms.advantages import compute_advantages
    from slime_rl.trainer_megatron.convert import SafetensorsFolder
    from slime_rl.trainer_megatron.trainer import MegatronTrainer

    torch.set_num_threads(1)
    cfg = make_config(Path(spec["model"]), spec.get("overrides", []))
    samples = make_samples(spec["num_samples"], spec["vocab"], seed=spec.get("seed", 1),
                           prompt=tuple(spec.get("prompt", (3, 9))), response=tuple(spec.get("response", (2, 12))))
    if spec.get("short_first"):  # (prompt, response) tokens: e.g. shorter than 2 * CP
        samples[0] = shortened(samples[0], *spec["short_first"])
    trainer = MegatronTrainer.from_config(cfg)
    if spec.get("random_routes"):  # routing replay of experts no router would pick: the same on every rank
        g = torch.Generator().manual_seed(7)
        moe, layers = trainer.shape.moe, trainer.shape.num_layers
        for sample in samples:
            scores = torch.rand(len(sample.tokens) - 1, layers, moe.num_experts, generator=g)
            sample.rollout_routed_experts = scores.argsort(-1)[..., : moe.topk].tolist()
    batch = shard_for(trainer, samples)
    result: dict = {}

    # HF -> Megatron -> HF: every rank must see exactly the tensors of the checkpoint.
    reader = SafetensorsFolder(spec["model"])
    exported = {name: t.cpu().clone() for bucket in trainer.named_weights(1 << 16) for name, t in bucket}
    result["exported_names"] = sorted(exported)
    result["local_experts"] = local_expert_count(trainer.model)
    result["experts_modules"] = sorted({type(m).__name__ for n, m in trainer.model.named_modules()
                                        if n.endswith("mlp.experts")})
    exact = sorted(exported) == sorted(reader.weight_map) and all(
        torch.equal(exported[n], reader.get(n)) for n in exported
    )
    everywhere = torch.tensor(int(exact), device=trainer.device)  # NCCL reduces CUDA tensors only
    torch.distributed.all_reduce(everywhere, op=torch.distributed.ReduceOp.MIN)
    result["roundtrip_exact"] = bool(everywhere)

    # sum_over_dp: every rank gets the sum over its data-parallel group, in the input's dtype
    mine = torch.tensor([trainer.data_parallel_rank + 1.0, 0.5], dtype=torch.float64)
    total = trainer.sum_over_dp(mine)
    result["dp_sum"] = {"sum": total.tolist(), "dtype": str(total.dtype), "input": mine.tolist()}
    # GRPO advantages on the shards, groups of two straddling them: the whole step's, put back in order
    scored = dataclasses.replace(batch)
    compute_advantages(scored, cfg.algorithm, n_samples_per_prompt=2, sum_over_dp=trainer.sum_over_dp)
    result["advantages"], _ = whole_step(scored, scored.advantages)

    log_probs = trainer.compute_log_probs(batch)
    result["log_probs"], result["peers_agree"] = whole_step(batch, log_probs)
    batch.old_log_probs = log_probs
    if spec.get("rollout_scatter"):  # the engine's log-probs off the trainer's, for a rollout correction
        batch.rollout_log_probs = log_probs - scatter(batch)
    if spec.get("ref"):
        batch.ref_log_probs = trainer.compute_log_probs(batch, model="ref")

    steps, save_after = spec.get("steps", 3), spec.get("save_after")
    result["metrics"] = []
    for k in range(steps):
        if save_after is not None and k == save_after:
            trainer.save(spec["ckpt"])
        if k == spec.get("offload_before"):  # what trainer.offload moves on a GPU, moved and back on the CPU
            offload_and_back(trainer)
        result["metrics"].append(trainer.train_step(batch))
    result["final"] = {n: t.cpu().clone() for b in trainer.named_weights(1 << 20) for n, t in b}
    if spec.get("save_hf"):
        trainer.save_hf(spec["save_hf"])

    if save_after is not None:
        del trainer
        resumed = MegatronTrainer.from_config(make_config(Path(spec["model"]), spec.get("resume_overrides",
                                                                                    spec.get("overrides", []))))
        resumed.load(spec["ckpt"])
        result["resumed_metrics"] = [resumed.train_step(batch) for _ in range(save_after, steps)]
        result["resumed_final"] = {n: t.cpu().clone() for b in resumed.named_weights(1 << 20) for n, t in b}
    return result


def offload_and_back(trainer) -> None:
    """The storages `MegatronTrainer.offload` frees (weights, optimizer tensors, gradient buffers without
    their contents) freed and restored on the CPU, where the trainer's own offload does nothing."""
    from slime_rl.trainer_megatron.offload import offload_storages, onload_storages
    from slime_rl.trainer_megatron.optimizer import optimizer_tensors

    grads = [g for p in trainer.model.parameters() if (g := getattr(p, "main_grad", None)) is not None]
    moved = offload_storages([*trainer.model.parameters(), *optimizer_tensors(trainer.optimizer)])
    moved += offload_storages(grads, keep=False)
    assert all(item.storage.nbytes() == 0 for item in moved)
    onload_storages(moved)


def run_hf_parity(spec: dict) -> dict:
    """|trainer - transformers| log-probs (transformers in the trainer's dtype, on its device)."""
    from megatron_testlib import hf_response_log_probs, load_hf, make_config, make_samples, per_sample

    from slime_rl.trainer_megatron.trainer import MegatronTrainer

    cfg = make_config(Path(spec["model"]), spec.get("overrides", []))
    samples = make_samples(spec["num_samples"], spec["vocab"], prompt=tuple(spec["prompt"]),
                           response=tuple(spec["response"]))
    trainer = MegatronTrainer.from_config(cfg)
    batch = shard_for(trainer, samples)
    ours = per_sample(batch, trainer.compute_log_probs(batch))
    hf = load_hf(Path(spec["model"])).to(trainer.device, trainer.dtype)
    diffs = [(torch.tensor(lp) - hf_response_log_probs(hf, s.tokens, s.response_length).cpu()).abs()
             for s, lp in zip(samples, ours, strict=True)]
    return {"abs_diff": torch.cat(diffs)}


def run_offload(spec: dict) -> dict:
    """Memory held before/after offload, and whether onload restores the same log-probs."""
    from megatron_testlib import make_config, make_samples

    from slime_rl.trainer_megatron.trainer import MegatronTrainer

    cfg = make_config(Path(spec["model"]), spec.get("overrides", []))
    samples = make_samples(spec["num_samples"], spec["vocab"], prompt=tuple(spec["prompt"]),
                           response=tuple(spec["response"]))
    trainer = MegatronTrainer.from_config(cfg)
    batch = shard_for(trainer, samples)
    trainer.train_step(batch)  # Adam moments exist
    before = trainer.compute_log_probs(batch)
    held = torch.cuda.memory_allocated()
    trainer.offload()
    offloaded = torch.cuda.memory_allocated()
    saved = {}
    if spec.get("ckpt"):  # saved while offloaded, as the loop does: the weights written are the real ones
        trainer.save(spec["ckpt"])
        saved["offloaded_after_save"] = torch.cuda.memory_allocated()
        fresh = MegatronTrainer.from_config(cfg)
        fresh.load(spec["ckpt"])
        saved["saved_log_probs_match"] = torch.equal(fresh.compute_log_probs(batch), before)
        del fresh
    trainer.onload()
    after = trainer.compute_log_probs(batch)
    batch.old_log_probs = after
    metrics = trainer.train_step(batch)  # gradients must still reach Megatron's grad buffers
    trained = trainer.compute_log_probs(batch)
    return {"held": held, "offloaded": offloaded, "same_log_probs": torch.equal(before, after),
            "grad_norm_after_onload": metrics["grad_norm"], "step_changed_log_probs": not torch.equal(trained, after),
            **saved}


def run_nonfinite_on_one_rank(spec: dict) -> dict:
    """Three steps; in the second, rank 1 alone gets an inf gradient (a hook on its tensor-parallel
    shard) while the loss stays finite. Per step: the metrics, and whether every rank's weights stayed."""
    from megatron_testlib import make_config, make_samples

    from slime_rl.trainer_megatron.trainer import MegatronTrainer

    torch.set_num_threads(1)
    trainer = MegatronTrainer.from_config(make_config(Path(spec["model"]), spec.get("overrides", [])))
    batch = shard_for(trainer, make_samples(spec["num_samples"], spec["vocab"]))
    param = next(p for n, p in trainer.model.named_parameters() if "linear_fc1" in n)
    result: dict = {"metrics": [], "unchanged": []}
    for k in range(3):
        hook = param.register_hook(lambda g: g * float("inf")) if k == 1 and torch.distributed.get_rank() == 1 else None
        before = [p.detach().clone() for p in trainer.model.parameters()]
        result["metrics"].append(trainer.train_step(batch))
        if hook is not None:
            hook.remove()
        same = all(torch.equal(a, p) for a, p in zip(before, trainer.model.parameters(), strict=True))
        everywhere = torch.tensor(int(same), device=trainer.device)
        torch.distributed.all_reduce(everywhere, op=torch.distributed.ReduceOp.MIN)
        result["unchanged"].append(bool(everywhere))
    return result


def run_grouped_experts_kernel(spec: dict) -> dict:
    """The first MoE layer's GroupedExperts on the trainer's device and dtype, through
    torch._grouped_mm and through its per-expert loop, on the same tokens (``spec["counts"]`` per
    expert): outputs and gradients of each, and the grouped GEMM calls each made."""
    from megatron_testlib import make_config

    from slime_rl.trainer_megatron import grouped_experts
    from slime_rl.trainer_megatron.trainer import MegatronTrainer

    trainer = MegatronTrainer.from_config(make_config(Path(spec["model"]), spec.get("overrides", [])))
    experts = next(m for m in trainer.model.modules() if isinstance(m, grouped_experts.GroupedExperts))
    counts = torch.tensor(spec["counts"])
    g = torch.Generator().manual_seed(0)
    hidden = experts.fc1_weight.shape[-1]
    tokens = torch.randn(int(counts.sum()), hidden, generator=g).to(trainer.device, trainer.dtype)
    probs = torch.rand(tokens.shape[0], generator=g).to(trainer.device)
    grad_out = torch.randn(tokens.shape[0], hidden, generator=g).to(trainer.device, trainer.dtype)
    real_grouped_mm, real_fits = torch._grouped_mm, grouped_experts._grouped_mm_fits
    # (also runs the one-time probe of the kernel, so that only the layer's own calls are counted)
    result: dict = {"fits": grouped_experts._grouped_mm_fits(tokens, experts.fc1_weight, experts.fc2_weight)}
    for path in ("grouped_mm", "per_expert"):
        calls = []
        torch._grouped_mm = lambda *a, calls=calls, **k: calls.append(1) or real_grouped_mm(*a, **k)
        if path == "per_expert":
            grouped_experts._grouped_mm_fits = lambda *tensors: False
        trainer.ddp.zero_grad_buffer()  # weight gradients land in Megatron's main_grad buffers
        x, p = tokens.clone().requires_grad_(), probs.clone().requires_grad_()
        try:
            out, _ = experts(x, counts, p)
            out.backward(grad_out)
        finally:
            torch._grouped_mm, grouped_experts._grouped_mm_fits = real_grouped_mm, real_fits
        result[path] = {"calls": len(calls), "tensors": [t.detach().float().cpu() for t in (
            out, x.grad, p.grad, experts.fc1_weight.main_grad, experts.fc2_weight.main_grad)]}
    return result


def run_packed_kernels(spec: dict) -> dict:
    """Packed micro-batches through each kernel of ``spec["kernels"]`` (trainer.megatron.packed_attention),
    each from the same initial weights: log-probs before and after one GRPO step, and that step's metrics."""
    from megatron_testlib import make_config, make_samples, per_sample

    from slime_rl.trainer_megatron.trainer import MegatronTrainer

    samples = make_samples(spec["num_samples"], spec["vocab"], prompt=tuple(spec["prompt"]),
                           response=tuple(spec["response"]))
    result: dict = {}
    for kernel in spec["kernels"]:
        overrides = [*spec.get("overrides", []), f"trainer.megatron.packed_attention={kernel}"]
        trainer = MegatronTrainer.from_config(make_config(Path(spec["model"]), overrides))
        batch = shard_for(trainer, samples)
        before = trainer.compute_log_probs(batch)
        batch.old_log_probs = before
        metrics = trainer.train_step(batch)
        after = trainer.compute_log_probs(batch)
        result[kernel] = {"before": per_sample(batch, before), "after": per_sample(batch, after), "metrics": metrics}
        del trainer
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return result


def run_critic(spec: dict) -> dict:
    """A critic (value head from zeros) fitting returns: its values before, and the metrics and values after
    each of ``steps`` steps, in step order."""
    from megatron_testlib import make_config, make_samples

    from slime_rl.trainer_megatron.trainer import MegatronTrainer

    torch.set_num_threads(1)
    cfg = make_config(Path(spec["model"]), spec.get("overrides", []))
    samples = make_samples(spec["num_samples"], spec["vocab"], prompt=tuple(spec["prompt"]),
                           response=tuple(spec["response"]))
    if spec.get("short_first"):
        samples[0] = shortened(samples[0], *spec["short_first"])
    critic = MegatronTrainer.from_config(cfg, role="critic")
    batch = shard_for(critic, samples)
    batch.returns = torch.linspace(-1.0, 1.0, batch.num_response_tokens)
    result: dict = {"values": [], "metrics": []}
    for _ in range(spec.get("steps", 2)):
        batch.values = critic.compute_values(batch)
        result["values"].append(whole_step(batch, batch.values)[0])
        result["metrics"].append(critic.train_step(batch))
    return result


SCENARIOS = {"critic": run_critic, "train": run_scenario, "packed_kernels": run_packed_kernels, "hf_parity": run_hf_parity, "offload": run_offload,
             "nonfinite_on_one_rank": run_nonfinite_on_one_rank, "grouped_experts_kernel": run_grouped_experts_kernel}


def main(spec_file: str | None = None) -> None:
    spec = json.loads(Path(spec_file or sys.argv[1]).read_text())
    sys.path.insert(0, str(Path(__file__).parent))
    from lora_scenario import run_lora
    from vlm_scenario import run_vlm, run_vlm_hf_parity

    result = {**SCENARIOS, "lora": run_lora, "vlm": run_vlm, "vlm_hf_parity": run_vlm_hf_parity}[
        spec.get("scenario", "train")](spec)
    if torch.distributed.get_rank() == 0:
        torch.save(result, spec["out"])
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
