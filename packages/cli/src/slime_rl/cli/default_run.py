"""The CPU default run: GRPO on SmolLM2-135M-Instruct learning two-number addition.

``slime-cli train`` with no config writes generated data and a config into a work
folder and trains on it. The reward is a plain user function loaded by
``module:attr``, the same way a user plugs in their own.

The work folder may hold other files: the example writes only the files below and its
runs' logs, checkpoints and rollout state, and a fresh start removes only those
(`remove_earlier_run`), never anything else, and only in a folder it wrote before.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import yaml

from slime_rl.core.run.run_dir import EARLIER_RUNS, LOG_ARTIFACTS, OWNER_FILE
from slime_rl.core.sample import Sample

PROMPT = "Question: What is {a} + {b}?\nAnswer:"
NUM_EVAL = 64
MARKER = ".slime-example.json"  # this folder is the built-in example's
PREPARED_FILES = ("train.jsonl", "eval.jsonl", "config.yaml")  # what prepare_default (over)writes
# What the example's runs write into the work folder (its logging.dir and checkpoint.save_dir),
# as globs: files, then whole folders.
RUN_FILES = (OWNER_FILE, "metrics.tmp", "checkpoints/latest", "checkpoints/latest.tmp",
             "rollout_state/buffer.sqlite*", "rollout_state/*/buffer.sqlite*",
             *LOG_ARTIFACTS, *(f"{EARLIER_RUNS}/*/{pattern}" for pattern in LOG_ARTIFACTS))
RUN_FOLDERS = ("checkpoints/step_[0-9]*",)


def addition_problems(seed: int = 0) -> tuple[list[dict], list[dict]]:
    """All pairs a, b in 1..50, shuffled; the first 64 are the held-out eval set."""
    pairs = [(a, b) for a in range(1, 51) for b in range(1, 51)]
    random.Random(seed).shuffle(pairs)
    rows = [{"input": PROMPT.format(a=a, b=b), "label": str(a + b)} for a, b in pairs]
    return rows[NUM_EVAL:], rows[:NUM_EVAL]


async def addition_reward(sample: Sample) -> float:
    """1.0 when the answer starts with the right sum (and not a longer number), else 0.0."""
    answer = sample.response.strip()
    label = str(sample.label)
    return float(answer.startswith(label) and not answer[len(label):len(label) + 1].isdigit())


def default_config(workdir: Path) -> dict:
    return {
        # auto: bf16 or fp32, whichever trains faster on this CPU (core.cpu: its flags, else a calibration)
        "model": {"path": "builtin:smollm2-135m-instruct", "dtype": "auto"},
        "data": {"prompt_data": str(workdir / "train.jsonl"), "rollout_batch_size": 4, "n_samples_per_prompt": 8,
                 "num_rollout": 30, "seed": 0},
        # 64 MiB weight-sync buckets and full recompute keep every process together under 5 GiB
        # (benchmarks/cpu_grpo_step.py): recompute costs ~0.5 s a step and saves ~0.9 GiB
        "rollout": {"engine": "hf", "temperature": 1.0, "max_response_len": 6, "update_weight_buffer_mb": 64,
                    "reward": "slime_rl.cli.default_run:addition_reward"},
        "algorithm": {"advantage_estimator": "grpo", "eps_clip": 0.2},
        "trainer": {"backend": "megatron", "lr": 2e-5, "adam_beta2": 0.999, "clip_grad": 1.0,
                    "max_tokens_per_gpu": 4096,  # the whole 32-sample batch in one micro-batch
                    "megatron": {"recompute": True}},
        "cluster": {"device": "cpu"},
        "eval": {"prompt_data": {"addition": str(workdir / "eval.jsonl")}, "temperature": 0.0, "interval": 10},
        "checkpoint": {"save_dir": str(workdir / "checkpoints"), "save_interval": 10, "keep_last": 2},
        "logging": {"dir": str(workdir)},
    }


def owns_workdir(workdir: Path) -> bool:
    """Whether the example wrote ``workdir`` before: its marker, or (from before the marker) its config,
    which then named bfloat16 where it now says auto."""
    workdir = Path(workdir).resolve()
    if (workdir / MARKER).is_file():
        return True
    try:
        found = yaml.safe_load((workdir / "config.yaml").read_text())
        found["model"]["dtype"] = "auto"
    except (OSError, ValueError, yaml.YAMLError, TypeError, KeyError):
        return False
    return found == default_config(workdir)


def foreign_files(workdir: Path) -> list[str]:
    """Files prepare_default would overwrite in a folder the example did not write."""
    if owns_workdir(workdir):
        return []
    return [name for name in PREPARED_FILES if (Path(workdir) / name).exists()]


def remove_earlier_run(workdir: Path) -> list[str]:
    """Remove what the example's earlier runs wrote in ``workdir`` (checkpoints, logs, rollout state)
    and nothing else; returns the paths removed, relative to ``workdir``. Only for a folder it owns."""
    workdir = Path(workdir).resolve()
    removed = []
    for pattern in RUN_FOLDERS:
        for folder in sorted(workdir.glob(pattern)):
            if folder.is_dir() and not folder.is_symlink():
                shutil.rmtree(folder)
                removed.append(folder)
    for pattern in RUN_FILES:
        for path in sorted(workdir.glob(pattern)):
            if path.is_file() or path.is_symlink():
                path.unlink()
                removed.append(path)
    for path in removed:  # the folders this emptied (a folder holding anything else stays)
        folder = path.parent
        while folder != workdir and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
            folder = folder.parent
    return [str(p.relative_to(workdir)) for p in removed]


def prepare_default(workdir: Path) -> Path:
    """Write the data and the config of the CPU default run; returns the config's path."""
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / MARKER).write_text(json.dumps({"written_by": "slime-cli train (the built-in example)",
                                              "files": list(PREPARED_FILES)}) + "\n")
    train_rows, eval_rows = addition_problems()
    for name, rows in (("train.jsonl", train_rows), ("eval.jsonl", eval_rows)):
        (workdir / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    config_path = workdir / "config.yaml"
    config_path.write_text(yaml.safe_dump(default_config(workdir), sort_keys=False))
    return config_path
