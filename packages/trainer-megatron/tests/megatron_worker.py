"""One rank of a multi-rank trainer test (launched by megatron_testlib.launch), or the same
scenario in-process at TP=1 (``run_scenario``), so both sides run identical code.

Scenario: build the trainer, export its weights (HF round trip), compute actor and
reference log-probs, train ``steps`` steps (saving a checkpoint after ``save_after``
steps when asked), then resume a fresh trainer from that checkpoint and redo the
remaining steps.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def run_scenario(spec: dict) -> dict:
    from megatron_testlib import make_config, make_samples

    from slime_rl.trainer_megatron.convert import SafetensorsFolder
    from slime_rl.trainer_megatron.trainer import MegatronTrainer

    torch.set_num_threads(1)
    cfg = make_config(Path(spec["model"]), spec.get("overrides", []))
    samples = make_samples(spec["num_samples"], spec["vocab"], seed=spec.get("seed", 1))
    trainer = MegatronTrainer.from_config(cfg)
    result: dict = {}

    # HF -> Megatron -> HF: every rank must see exactly the tensors of the checkpoint.
    reader = SafetensorsFolder(spec["model"])
    exported = {name: t.clone() for bucket in trainer.named_weights(1 << 16) for name, t in bucket}
    result["exported_names"] = sorted(exported)
    exact = sorted(exported) == sorted(reader.weight_map) and all(
        torch.equal(exported[n], reader.get(n)) for n in exported
    )
    everywhere = torch.tensor(int(exact))
    torch.distributed.all_reduce(everywhere, op=torch.distributed.ReduceOp.MIN)
    result["roundtrip_exact"] = bool(everywhere)

    result["log_probs"] = trainer.compute_log_probs(samples)
    ref = trainer.compute_log_probs(samples, model="ref") if spec.get("ref") else None
    for s, lp in zip(samples, result["log_probs"]):
        s.old_log_probs = list(lp)
    if ref is not None:
        for s, lp in zip(samples, ref):
            s.ref_log_probs = list(lp)

    steps, save_after = spec.get("steps", 3), spec.get("save_after")
    result["metrics"] = []
    for k in range(steps):
        if save_after is not None and k == save_after:
            trainer.save(spec["ckpt"])
        result["metrics"].append(trainer.train_step(samples))
    result["final"] = {n: t.clone() for b in trainer.named_weights(1 << 20) for n, t in b}
    if spec.get("save_hf"):
        trainer.save_hf(spec["save_hf"])

    if save_after is not None:
        del trainer
        resumed = MegatronTrainer.from_config(cfg)
        resumed.load(spec["ckpt"])
        result["resumed_metrics"] = [resumed.train_step(samples) for _ in range(save_after, steps)]
        result["resumed_final"] = {n: t.clone() for b in resumed.named_weights(1 << 20) for n, t in b}
    return result


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    sys.path.insert(0, str(Path(__file__).parent))
    result = run_scenario(spec)
    if torch.distributed.get_rank() == 0:
        torch.save(result, spec["out"])
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
