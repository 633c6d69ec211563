"""A resume compares its config with the checkpoint's before anything starts: every changed key is
honoured (one line says so) or refused (one line names it and the fix). docs/reliability.md#resume.

A checkpoint's meta.json holds the run's resolved config (`Config.to_dict`: secrets redacted) and the
identity of its data by content (`data_identity`); `check_resume` reads both. `RESUME_RULES` is the
table of which keys can change on a resume and why the others cannot; the first matching pattern wins,
and a test checks that every key of the config has a rule of its own.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import reprlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slime_rl.core.config import ConfigError

if TYPE_CHECKING:
    from slime_rl.core.config import Config


@dataclass(frozen=True)
class Rule:
    pattern: str  # a dotted key, fnmatch-style (``trainer.*``)
    honoured: bool
    why: str  # honoured: how it takes effect; refused: why the checkpoint fixes it


def _refuse(pattern: str, why: str) -> Rule:
    return Rule(pattern, False, why)


def _honour(pattern: str, why: str) -> Rule:
    return Rule(pattern, True, why)


RESUME_RULES: tuple[Rule, ...] = (
    # What the checkpoint's weights, optimizer state, RNG and data state are tied to.
    _refuse("model.path", "the checkpoint's weights and Adam moments are that model's"),
    _refuse("model.tokenizer_path", "the token ids in the checkpoint's buffer are that tokenizer's"),
    _refuse("model.dtype", "the checkpoint's weights and optimizer state are in that dtype"),
    _honour("model.ref_path", "the KL reference model is loaded from it as the run starts"),
    _honour("model.critic_path", "no effect on a resume: the critic continues from the checkpoint's"),
    _refuse("algorithm.advantage_estimator", "the checkpoint holds that estimator's state (a critic or none)"),
    _refuse("algorithm.loss_type", "the checkpoint was trained with that loss"),
    _refuse("algorithm.policy_loss", "the checkpoint was trained with that policy loss"),
    _honour("algorithm.*", "the loss uses it from the next step"),
    _refuse("trainer.backend", "the checkpoint is in that trainer's format"),
    _refuse("trainer.lora.rank", "the checkpoint's adapters have that shape"),
    _refuse("trainer.lora.target_modules", "the checkpoint's adapters sit on those modules"),
    _refuse("trainer.lora.alpha", "the adapters were trained at that scale (alpha / rank)"),
    _refuse("trainer.seed", "the checkpoint's RNG state continues the run"),
    _honour("trainer.lr", "the schedule continues at the checkpoint's step with the new value"),
    _honour("trainer.min_lr", "the schedule continues at the checkpoint's step with the new value"),
    _honour("trainer.lr_warmup_steps", "the schedule continues at the checkpoint's step with the new value"),
    _honour("trainer.lr_decay_style", "the schedule continues at the checkpoint's step with the new value"),
    _honour("trainer.*", "the trainer uses it from the next step"),
    _refuse("parallel.expert_*", "an expert-parallel checkpoint is not resharded to another layout"),
    _honour("parallel.*", "the checkpoint is resharded to the new layout (RNG streams start afresh)"),
    _refuse("data.source", "the checkpoint's data state is that source's"),
    _refuse("data.buffer", "the checkpoint's buffer state is that buffer's"),
    _refuse("data.seed", "the order of the data is the checkpoint's (seed and shuffle are saved with it)"),
    _refuse("data.shuffle", "the order of the data is the checkpoint's (seed and shuffle are saved with it)"),
    _honour("data.prompt_data", "the same data (by content) at another path"),
    _honour("data.*", "the data source uses it from the next step"),
    _refuse("cluster.async_mode", "the checkpoint's rollout state holds that mode's groups in flight"),
    _honour("cluster.*", "the run is placed by the new value"),
    _honour("rollout.*", "the rollout uses it from the next step"),
    _honour("eval.*", "evaluation uses it from now on"),
    _honour("checkpoint.*", "saving uses it from now on"),
    _honour("logging.*", "logging uses it from now on"),
    _honour("roles*", "the served roles start anew from it as the run starts (they are frozen: no state)"),
)
# Keys that differ on every resume, or are the resume itself.
_NOT_COMPARED = ("checkpoint.resume", "checkpoint.save_dir")
_FRESH_RUN = "start a fresh run (checkpoint.resume=false, another checkpoint.save_dir)"


def rule_for(key: str) -> Rule | None:
    return next((r for r in RESUME_RULES if fnmatch.fnmatchcase(key, r.pattern)), None)


def leaves(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` as ``{"a.b": 1}``; lists stay values."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(leaves(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def check_resume(cfg: Config, meta: dict[str, Any], *, out: Any = None) -> list[str]:
    """Compare ``cfg`` with the config the checkpoint (``meta``) was written with. Prints (to ``out``,
    default stderr) and returns one line per honoured change; raises ConfigError naming every refused
    change and its fix, each also printed on a line of its own, before Ray starts."""
    out = out or sys.stderr
    saved_config = meta.get("config")
    if not isinstance(saved_config, dict):
        notes = ["resume: the checkpoint (written before slime-rl kept its config) has no config to compare;"
                 " changes since are not checked"]
    else:
        notes, refused = _compare(leaves(saved_config), leaves(cfg.to_dict()), int(meta.get("step", 0)))
        data_note, data_refusal = _compare_data(cfg, meta.get("data"))
        notes += data_note
        refused += data_refusal
        for line in refused:
            print(f"slime-rl: resume refused: {line}", file=out, flush=True)
        if refused:
            raise ConfigError("checkpoint.resume", f"{len(refused)} change(s) cannot be honoured on a resume: "
                                                   + "; ".join(refused))
    for line in notes:
        print(f"slime-rl: {line}", file=out, flush=True)
    return notes


def _shown(value: Any) -> str:
    return reprlib.repr(value) if isinstance(value, list | dict) else str(value)


def _compare(saved: dict[str, Any], now: dict[str, Any], step: int) -> tuple[list[str], list[str]]:
    notes, refused = [], []
    for key in sorted(set(saved) | set(now)):
        if key in _NOT_COMPARED or key == "data.prompt_data" or key.startswith("eval.prompt_data"):
            continue  # the data is compared by content (_compare_data)
        before, after = saved.get(key), now.get(key)
        if before == after:
            continue
        change = f"{key}: {_shown(before)} -> {_shown(after)}"
        rule = rule_for(key)
        if rule is None:  # a plugin's own key (a backend's settings section with no rule): said, not refused
            notes.append(f"resume: {change}: honoured (a key with no resume rule; its backend decides)")
        elif rule.honoured:
            notes.append(f"resume: {change}: honoured from step {step + 1} ({rule.why})")
        else:
            refused.append(f"{change} cannot change on a resume ({rule.why}); set it back to {_shown(before)},"
                           f" or {_FRESH_RUN}")
    return notes, refused


def _compare_data(cfg: Config, saved: Any) -> tuple[list[str], list[str]]:
    """The prompt data by content: other content is refused (the data state is positions in that
    data), the same content at another path is said; an eval set's new content is said."""
    if not isinstance(saved, dict):
        return (["resume: the checkpoint does not identify its data by content; data.prompt_data is not"
                 " checked"], [])
    notes, refused = [], []
    current = data_identity(cfg)
    for key in sorted(set(saved) ^ set(current)):  # an eval set added or removed
        notes.append(f"resume: {key}: {'added' if key in current else 'removed'}: honoured (evaluation uses it"
                     " from now on)")
    for key, now in current.items():
        then = saved.get(key)
        if not isinstance(then, dict) or now is None or then.get("sha256") == now["sha256"]:
            if isinstance(then, dict) and now is not None and then.get("path") != now["path"]:
                notes.append(f"resume: {key}: {then.get('path')} -> {now['path']}: honoured (the same content,"
                             f" sha256 {now['sha256'][:12]})")
            continue
        differs = (f"{now['path']} is not the data the checkpoint was trained on (sha256 {then.get('sha256', '')[:12]},"
                   f" {then.get('bytes')} bytes at the checkpoint; {now['sha256'][:12]}, {now['bytes']} bytes now)")
        if key == "data.prompt_data":
            refused.append(f"{key}: {differs}; resume with that data, or {_FRESH_RUN}")
        else:
            notes.append(f"resume: {key}: {differs}: honoured (evaluation reads the new data)")
    return notes, refused


# Files up to this size are hashed whole; larger ones by a sample of blocks plus their size.
FULL_HASH_BYTES = 64 << 20
_SAMPLE_BLOCKS, _BLOCK = 64, 64 << 10
_identities: dict[tuple[str, int, int], dict[str, Any]] = {}


def data_identity(cfg: Config) -> dict[str, dict[str, Any] | None]:
    """``{"data.prompt_data": identity, "eval.prompt_data.<name>": identity}``; None for a key that names
    no file (a data source's own kind of name)."""
    files = {"data.prompt_data": cfg.data.prompt_data,
             **{f"eval.prompt_data.{name}": path for name, path in cfg.eval.prompt_data.items()}}
    return {key: file_identity(Path(path)) if path and Path(path).is_file() else None
            for key, path in files.items() if path}


def file_identity(path: Path) -> dict[str, Any]:
    """A file by content: its size and SHA-256 (of a sample of 64 KiB blocks spread over it, first and
    last included, when it is over FULL_HASH_BYTES), cached while its size and mtime stay."""
    stat = path.stat()
    cache_key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if cache_key in _identities:
        return _identities[cache_key]
    digest = hashlib.sha256()
    sampled = stat.st_size > FULL_HASH_BYTES
    with path.open("rb") as f:
        if not sampled:
            while chunk := f.read(8 << 20):
                digest.update(chunk)
        else:
            digest.update(str(stat.st_size).encode())
            span = stat.st_size - _BLOCK
            for i in range(_SAMPLE_BLOCKS):
                f.seek(span * i // (_SAMPLE_BLOCKS - 1))
                digest.update(f.read(_BLOCK))
    identity = {"path": os.path.abspath(path), "bytes": stat.st_size, "sha256": digest.hexdigest(),
                "sampled": sampled}
    _identities[cache_key] = identity
    return identity
