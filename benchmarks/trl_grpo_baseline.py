"""TRL's GRPOTrainer on the CPU demo's model, task and batch: the baseline issue 21 compares `make demo` with.

Same model (the built-in SmolLM2-135M-Instruct, as slime-cli converts it), same prompts and reward
(slime_rl.cli.default_run), 4 prompts x 8 samples a step, <= 6 new tokens, temperature 1, fp32,
gradient checkpointing, no KL and a constant learning rate (as the demo), 30 steps; prints the median step time and the
held-out greedy accuracy before and after. Needs trl in its own venv (it is no dependency of ours):

    python3.11 -m venv /tmp/trlvenv && /tmp/trlvenv/bin/pip install torch==2.13.0 trl==1.16.0
    PYTHONPATH=packages/cli/src:packages/core/src OMP_NUM_THREADS=2 \\
        /tmp/trlvenv/bin/python benchmarks/trl_grpo_baseline.py [--model ~/.cache/slime-rl/models/smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from slime_rl.cli.default_run import addition_problems


def correct(completion: str, label: str) -> float:
    """The demo's reward (default_run.addition_reward) on text."""
    answer = completion.strip()
    return float(answer.startswith(label) and not answer[len(label):len(label) + 1].isdigit())


def reward(completions: list[str], label: list[str], **_) -> list[float]:
    return [correct(c, lab) for c, lab in zip(completions, label, strict=True)]


def accuracy(model, tokenizer, rows: list[dict]) -> float:
    """Greedy pass@1 on the held-out rows, as the demo's eval."""
    model.eval()
    hits = []
    with torch.no_grad():
        for row in rows:
            ids = tokenizer(row["input"], return_tensors="pt").input_ids
            out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.eos_token_id)
            hits.append(correct(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True), row["label"]))
    model.train()
    return sum(hits) / len(hits)


class StepTimes(TrainerCallback):
    def __init__(self):
        self.times: list[float] = []
        self._start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path.home() / ".cache/slime-rl/models/smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=1e-5)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))

    train_rows, eval_rows = addition_problems()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    before = accuracy(model, tokenizer, eval_rows)
    config = GRPOConfig(
        output_dir="/tmp/trl_grpo_baseline", max_steps=args.steps, learning_rate=args.lr,
        per_device_train_batch_size=32, num_generations=8, generation_batch_size=32, max_completion_length=6,
        temperature=1.0, beta=0.0, lr_scheduler_type="constant", gradient_checkpointing=True, use_cpu=True, bf16=False, report_to="none",
        logging_steps=1, save_strategy="no", seed=0, dataloader_num_workers=0,
    )
    dataset = Dataset.from_list([{"prompt": r["input"], "label": r["label"]} for r in train_rows])
    times = StepTimes()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[times])
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    after = accuracy(trainer.model, tokenizer, eval_rows)
    print(f"TRL GRPOTrainer, {args.steps} steps, 4 prompts x 8 samples, fp32, gradient checkpointing, lr {args.lr:g},"
          f" {torch.get_num_threads()} threads")
    print(f"| median step s | {args.steps} steps s | held-out accuracy |")
    print("|---|---|---|")
    print(f"| {statistics.median(times.times):.2f} | {wall:.0f} | {before:.3f} -> {after:.3f} |")


if __name__ == "__main__":
    main()
