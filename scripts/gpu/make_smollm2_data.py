"""Write the SmolLM2 real-model run's prompts (examples/smollm2_gpu_*.yaml) as JSONL, here on the CPU machine.

The GPU machine has no reasoning-gym and no network, so the data is generated here and carried
(scripts/gpu/pack_smollm2.sh). Two tasks, each a train file and a held-out eval file (no prompt in both):

- addition: the CPU default's task (slime_rl.cli.default_run.addition_problems: a + b for a, b in 1..50);
- addition256: the same pairs with 256 held out, for issue 38's FP8 comparison (scripts/gpu/fp8_real_model.sh):
  at an accuracy near 0.6, a 0.1 difference between two runs is ~1.2 standard errors over 64 prompts, ~2.3
  over 256;
- chain_sum: reasoning-gym's ``chain_sum`` (two terms of 1-2 digits joined by + or -, so half the answers are
  differences and some negative): a task the 135M model learns. The CPU default's run (rollout-hf, Megatron
  over gloo, 4 prompts x 8 samples, lr 2e-5, bf16) on this data, 2026-12-02, 2-core Xeon: held-out greedy pass@1
  0.078 at step 0 and 10, 0.531 at step 20, 0.422 at step 30 (addition: 0.016 -> 0.69, docs/async.md).

Both prompts end in "Answer:"; both tasks score with the CPU default's reward (the response starts with the
label's number), which gives 1.0 exactly where reasoning-gym's own chain_sum scorer gives full credit, for numbers
written plainly (tests/e2e/test_real_model_run.py checks it).

    python scripts/gpu/make_smollm2_data.py --out .gpu/smol-data
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from slime_rl.cli.default_run import addition_problems

CHAIN_SUM = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}
PROMPT = "Question: {question}\nAnswer:"  # the addition task's form (default_run.PROMPT)
TASKS = ("addition", "chain_sum")
FP8_EVAL_PROMPTS = 256


def chain_sum_problems(num_train: int = 2000, num_eval: int = 64, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """reasoning-gym chain_sum prompts: ``num_train`` to train on and ``num_eval`` held out, no question in both."""
    import reasoning_gym

    def rows(size: int, dataset_seed: int) -> list[dict]:
        dataset = reasoning_gym.create_dataset("chain_sum", size=size, seed=dataset_seed, **CHAIN_SUM)
        return [{"input": PROMPT.format(question=e["question"]), "label": e["answer"],
                 "metadata": {"source_dataset": "chain_sum", "expression": e["metadata"]["expression"]}}
                for e in dataset]

    held_out = _unique(rows(4 * num_eval, seed + 1))[:num_eval]
    seen = {r["input"] for r in held_out}
    train = [r for r in _unique(rows(2 * num_train, seed)) if r["input"] not in seen][:num_train]
    if len(held_out) < num_eval or len(train) < num_train:
        raise ValueError(f"chain_sum {CHAIN_SUM} has too few distinct questions for {num_train} + {num_eval}")
    return train, held_out


def _unique(rows: list[dict]) -> list[dict]:
    return list({r["input"]: r for r in rows}.values())


def write_task_data(out: Path) -> dict[str, Path]:
    """Write ``<task>_train.jsonl`` and ``<task>_eval.jsonl`` for every task into ``out``; returns the paths."""
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    splits = {"addition": addition_problems(), "addition256": addition_problems(num_eval=FP8_EVAL_PROMPTS),
              "chain_sum": chain_sum_problems()}
    for task, (train, held_out) in splits.items():
        for split, rows in (("train", train), ("eval", held_out)):
            path = out / f"{task}_{split}.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
            written[f"{task}_{split}"] = path
    return written


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(".gpu/smol-data"))
    for path in write_task_data(parser.parse_args().out).values():
        print(f"{path}  {sum(1 for _ in path.open())} prompts")
