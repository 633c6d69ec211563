"""The ``disk`` transport: an HF folder written shard by shard (one safetensors file per bucket),
completed with the base model's config and tokenizer files, loaded with ``/update_weights_from_disk``.
A restarted server is restored from such a folder too (engine_sync.py, restore_copy.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from slime_rl.core.contracts import NamedTensors
from slime_rl.rollout_sglang.weights.server_api import Target, post

_HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja")


def write_shard(folder: str | Path, index: int, named_tensors: NamedTensors) -> Path:
    """One bucket as ``model-{index:05d}.safetensors`` in ``folder``."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"model-{index:05d}.safetensors"
    save_file({name: t.detach().to("cpu").contiguous() for name, t in named_tensors}, str(path))
    return path


def finish_hf_folder(folder: str | Path, base_model_path: str | Path) -> Path:
    """Make ``folder`` a loadable HF model: the base model's config and tokenizer files and
    a ``model.safetensors.index.json`` over the shards written so far."""
    from safetensors import safe_open

    folder, base = Path(folder), Path(base_model_path)
    for name in _HF_FILES:
        if (base / name).is_file():
            shutil.copy2(base / name, folder / name)
    weight_map, total = {}, 0
    for shard in sorted(folder.glob("model-*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():
                weight_map[key] = shard.name
        total += shard.stat().st_size
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return folder


def save_hf_folder(named_tensors: NamedTensors, folder: str | Path, base_model_path: str | Path) -> Path:
    write_shard(folder, 0, named_tensors)
    return finish_hf_folder(folder, base_model_path)


def update_from_disk(target: Target, folder: str | Path, *, version: int | None, timeout: float, step: str) -> None:
    body: dict[str, Any] = {"model_path": str(folder), "flush_cache": False}
    if version is not None:
        body["weight_version"] = str(version)
    post(target, "/update_weights_from_disk", body, timeout=timeout, step=step)
