"""The CPU default run: GRPO on SmolLM2-135M-Instruct learning two-number addition.

``slime-cli train`` with no config writes generated data and a config into a work
folder and trains on it. The reward is a plain user function loaded by
``module:attr``, the same way a user plugs in their own.

The work folder may hold other files: the example (over)writes only the files below, and a
fresh start removes only what its earlier runs provably wrote (`remove_earlier_run`): logs that
their ``run.json`` proves, rollout state and checkpoint folders marked with their run id, never
through a symlink. Anything else stays; if it is in the way, the run refuses it in one line.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import yaml

from slime_rl.core.run import checkpoint
from slime_rl.core.run.run_dir import EARLIER_RUNS, OWNER_FILE, proven_logs, read_record, rollout_state_dir
from slime_rl.core.sample import Sample

PROMPT = "Question: What is {a} + {b}?\nAnswer:"
NUM_EVAL = 64
MARKER = ".slime-example.json"  # this folder is the built-in example's: what it wrote, with each file's sha256
PREPARED_FILES = ("train.jsonl", "eval.jsonl", "config.yaml")  # what prepare_default (over)writes


def addition_problems(seed: int = 0, num_eval: int = NUM_EVAL) -> tuple[list[dict], list[dict]]:
    """All pairs a, b in 1..50, shuffled; the first ``num_eval`` are the held-out eval set."""
    pairs = [(a, b) for a in range(1, 51) for b in range(1, 51)]
    random.Random(seed).shuffle(pairs)
    rows = [{"input": PROMPT.format(a=a, b=b), "label": str(a + b)} for a, b in pairs]
    return rows[num_eval:], rows[:num_eval]


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
    if (workdir / MARKER).is_file() and not (workdir / MARKER).is_symlink():
        return True
    return _is_old_example_config(workdir)


def _is_old_example_config(workdir: Path) -> bool:
    try:
        found = yaml.safe_load((workdir / "config.yaml").read_text())
        found["model"]["dtype"] = "auto"
    except (OSError, ValueError, yaml.YAMLError, TypeError, KeyError):
        return False
    return found == default_config(workdir)


def foreign_files(workdir: Path) -> list[str]:
    """Files prepare_default would overwrite that the example did not write: not the content its
    marker recorded (a user's, or one the user changed), or a symlink (writing would go through it)."""
    workdir = Path(workdir).resolve()
    try:
        written = json.loads((workdir / MARKER).read_text()).get("sha256", {})
    except (OSError, ValueError, AttributeError):
        written = {}
    written = written if isinstance(written, dict) else {}
    return [name for name in PREPARED_FILES
            if ((workdir / name).exists() or (workdir / name).is_symlink()) and not _is_examples(workdir, name, written)]


def _is_examples(workdir: Path, name: str, written: dict) -> bool:
    """The file is what the example wrote (the marker's hash) or would write (its data; an old config)."""
    path = workdir / name
    if path.is_symlink() or not path.is_file():
        return False
    if written.get(name) == _sha256(path):
        return True
    return _is_old_example_config(workdir) if name == "config.yaml" else _read(path) == _example_data(name)


def remove_earlier_run(workdir: Path) -> list[str]:
    """Remove what the example's earlier runs in ``workdir`` provably wrote, and nothing else: the logs
    their run.json proves (here and in earlier_runs/), their rollout state, their checkpoint folders
    (each names its run in owner.json or meta.json) and a ``latest`` naming one of those. Nothing
    through a symlink. Returns the paths removed, relative to ``workdir``. Only for a folder it owns."""
    workdir = Path(workdir).resolve()
    removed: list[Path] = []
    runs: set[str] = set()
    records = [workdir, *sorted(p for p in (workdir / EARLIER_RUNS).glob("*") if _plain_dir(workdir, p))]
    for folder in records:
        record = read_record(folder)
        if record.run_id is None or (folder / OWNER_FILE).is_symlink():
            continue
        runs.add(record.run_id)  # its checkpoints name it (checksummed meta.json, owner.json)
        if record.started_ns is None:
            continue  # a run.json from before records proves no single log file: they stay
        for path in [*proven_logs(folder), folder / OWNER_FILE]:
            path.unlink()
            removed.append(path)
    for run_id in sorted(runs):
        state = rollout_state_dir(workdir, run_id)
        if _plain_dir(workdir, state):
            for path in sorted(state.glob("buffer.sqlite*")):
                if path.is_file() and not path.is_symlink():
                    path.unlink()
                    removed.append(path)
    save_dir = workdir / "checkpoints"
    if _plain_dir(workdir, save_dir):  # a symlink: another place's, left alone (a run there is refused)
        for folder in sorted(save_dir.glob("step_*")):
            if _plain_dir(workdir, folder) and checkpoint.folder_owner(folder) in runs:
                shutil.rmtree(folder)
                removed.append(folder)
        pointer = save_dir / "latest"
        if pointer.is_file() and not pointer.is_symlink() and save_dir / str(checkpoint.latest_name(save_dir)) in removed:
            pointer.unlink()
            removed.append(pointer)
    for path in removed:  # the folders this emptied (a folder holding anything else stays)
        folder = path.parent
        while folder != workdir and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
            folder = folder.parent
    return [str(p.relative_to(workdir)) for p in removed]


def _plain_dir(workdir: Path, folder: Path) -> bool:
    """A folder under ``workdir`` with no symlink on the way."""
    return folder.is_dir() and folder.resolve() == workdir / folder.relative_to(workdir)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _example_data(name: str) -> str:
    train_rows, eval_rows = addition_problems()
    return "".join(json.dumps(r) + "\n" for r in (train_rows if name == "train.jsonl" else eval_rows))


def prepare_default(workdir: Path) -> Path:
    """Write the data and the config of the CPU default run, and the marker recording what it wrote;
    returns the config's path. Each file is replaced whole, never written through a symlink."""
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    contents = {name: _example_data(name) for name in ("train.jsonl", "eval.jsonl")}
    contents["config.yaml"] = yaml.safe_dump(default_config(workdir), sort_keys=False)
    marker = {"written_by": "slime-cli train (the built-in example)", "files": list(PREPARED_FILES),
              "sha256": {name: hashlib.sha256(text.encode()).hexdigest() for name, text in contents.items()}}
    _replace(workdir / MARKER, json.dumps(marker) + "\n")  # first: a kill mid-way leaves files it vouches for
    for name, text in contents.items():
        _replace(workdir / name, text)
    return workdir / "config.yaml"


def _replace(path: Path, text: str) -> None:
    """Write ``path`` whole through a new temporary file (a name no one else's file has)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
