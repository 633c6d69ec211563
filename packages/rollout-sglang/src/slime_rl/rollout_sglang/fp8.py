"""The SGLang side of ``rollout.precision: fp8`` and ``rollout.kv_cache_dtype: fp8_e4m3`` (docs/fp8.md).

The servers start from an FP8 copy of the model (`prepare_served_folder`): its projections quantised by
core's `slime_rl.core.weights.fp8` and a ``quantization_config`` in its config.json (SGLang's ``Fp8Config``:
quant_method fp8, weight_block_size [b, b], dynamic activations), so SGLang builds each projection as an FP8
``weight`` with a float32 ``weight_scale_inv`` and loads the copy as it loads DeepSeek-V3's checkpoints. Every
sync then pushes (weight, weight_scale_inv) pairs, quantised by the trainer, into those parameters in place.
A bf16 checkpoint with the quantization_config injected by ``--json-model-override-args`` would build the
same parameters, but its bf16 weights would be cast into them unscaled and its scales left at float32's
minimum: the served weights would be garbage until the first sync.

GPUs below compute capability 8.9 have no FP8 tensor cores (SGLang would fall back to weight-only Marlin
kernels, another computation than the one measured): an engine refuses to start there (`check_gpus`). So
does one on compute capability 10.x, where SGLang re-quantises block scales to UE8M0 for DeepGEMM after
loading (fp8_utils.requant_block_scale_ue8m0_for_deepgemm), a derived copy an in-place update leaves stale.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slime_rl.core.config import ConfigError
from slime_rl.core.weights.fp8 import FP8Format, block_edge, model_partitions, quantize_named

if TYPE_CHECKING:
    from slime_rl.core.config import Config

logger = logging.getLogger(__name__)

MIN_CAPABILITY = (8, 9)  # Ada (L4, L40) and Hopper (H100, H200): FP8 tensor cores
STALE_SCALES_MAJOR = 10  # Blackwell B200/GB200: scales re-laid after loading (see the module)
STAMP = "slime-rl-fp8.json"  # what a served folder was made from; a match is reused


def served_folder(cfg: Config) -> Path:
    """Where the servers' FP8 copy of the model is (the engine and the trainer's sender both read it)."""
    from slime_rl.rollout_sglang.launch import work_dir

    return work_dir(cfg) / "fp8-model"


def fp8_format(model_path: str | Path, tp_size: int) -> FP8Format:
    """Block scales with the largest edge of 128, 64, 32, 16 that divides every partition an engine of
    ``tp_size`` fuses or splits (SGLang refuses a block that does not: SmolLM2-135M's 576/192/192 take 64)."""
    hf = _hf_config(model_path)
    try:
        partitions = model_partitions(hf, tp_size)
    except KeyError as err:
        raise ConfigError("rollout.precision", f"{model_path}/config.json has no {err}: the FP8 block size cannot"
                                               " be chosen for it; set rollout.precision=model") from None
    edge = block_edge(partitions)
    if edge is None:
        raise ConfigError("rollout.precision", f"no FP8 block edge of 128, 64, 32 or 16 divides the model's"
                                               f" partitions {partitions} at engine TP {tp_size}; set"
                                               " rollout.precision=model")
    return FP8Format("block", edge)


def server_flags(cfg: Config) -> dict[str, Any]:
    """The SGLang flags rollout.precision and rollout.kv_cache_dtype imply."""
    r, flags = cfg.rollout, {}
    if r.kv_cache_dtype != "auto":
        flags["kv_cache_dtype"] = r.kv_cache_dtype
    if r.precision == "fp8" and fp8_format(cfg.model.path, cfg.cluster.rollout_num_gpus_per_engine).block != 128:
        flags["fp8_gemm_backend"] = "triton"  # DeepGEMM and CUTLASS block GEMMs take 128x128 blocks only
    return flags


def prepare_served_folder(cfg: Config) -> Path:
    """The FP8 copy of ``model.path`` the servers start from, made once per run folder (reused while the
    model's weight files and the format are the ones it was made from)."""
    fmt = fp8_format(cfg.model.path, cfg.cluster.rollout_num_gpus_per_engine)
    return write_served_folder(cfg.model.path, served_folder(cfg), fmt)


def write_served_folder(model_path: str | Path, folder: Path, fmt: FP8Format) -> Path:
    """``model_path``'s weights as ``folder``: projections in FP8 with their scales, the rest as they are,
    shard by shard (one source shard in memory at a time, quantised on a GPU when this process has one)."""
    import torch
    from safetensors import safe_open

    from slime_rl.rollout_sglang.weights.disk import finish_hf_folder, write_shard

    source = Path(model_path)
    shards = sorted(source.glob("*.safetensors"))
    if not shards:
        raise ConfigError("rollout.precision", f"{source} has no .safetensors weights to quantise for the FP8"
                                               " engines; convert the model to safetensors first")
    stamp = {"source": str(source.resolve()), "format": asdict(fmt),
             "files": {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in shards}}
    if (folder / STAMP).is_file() and json.loads((folder / STAMP).read_text()) == stamp:
        return folder
    device = "cuda" if torch.cuda.is_available() else "cpu"
    partial = folder.with_name(f"{folder.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    for index, shard in enumerate(shards):
        with safe_open(str(shard), framework="pt") as f:
            named = [(key, f.get_tensor(key).to(device)) for key in f.keys()]
        write_shard(partial, index, quantize_named(named, fmt))
        del named
    finish_hf_folder(partial, source)
    for extra in source.iterdir():  # the tokenizer and any other file the server reads beside the weights
        if extra.is_file() and extra.suffix not in (".safetensors", ".bin", ".pt") and not (partial / extra.name).exists():
            shutil.copy2(extra, partial / extra.name)
    hf = _hf_config(source)
    hf["quantization_config"] = fmt.quantization_config()
    (partial / "config.json").write_text(json.dumps(hf, indent=1))
    (partial / STAMP).write_text(json.dumps(stamp))
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    logger.info("FP8 copy of %s for the engines: %s (%s)", source, folder, fmt)
    return folder


def _hf_config(model_path: str | Path) -> dict:
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise ConfigError("rollout.precision", f"{path} does not exist: the FP8 engines need an HF model folder")
    hf = json.loads(path.read_text())
    if not isinstance(hf, dict):
        raise ConfigError("model.path", f"{path} holds a {type(hf).__name__}, not an HF config mapping")
    if "quantization_config" in hf:
        raise ConfigError("rollout.precision", f"{path} is already quantised ({hf['quantization_config']}):"
                                               " rollout.precision=fp8 serves FP8 copies of a model the trainer"
                                               " holds in bf16 or fp32; give that model, or set"
                                               " rollout.precision=model")
    return hf


# ---------------------------------------------------------------------- the GPUs

def gpu_capabilities() -> dict[int, tuple[str, tuple[int, int]]] | None:
    """Each GPU's (name, compute capability) by its physical index, from nvidia-smi; None without it."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,name,compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    caps = {}
    for line in out.strip().splitlines():
        index, name, cap = (part.strip() for part in line.rsplit(",", 2)) if line.count(",") >= 2 else ("", "", "")
        if index.isdigit() and "." in cap:
            major, minor = cap.split(".", 1)
            caps[int(index)] = (name, (int(major), int(minor)))
    return caps


def check_gpus(cfg: Config, gpu_ids: list[list[int]] | None,
               query: Callable[[], dict[int, tuple[str, tuple[int, int]]] | None] = gpu_capabilities) -> None:
    """Refuse to start FP8 engines (weights or KV cache) on GPUs that cannot serve them (see the module)."""
    r = cfg.rollout
    field = "rollout.precision" if r.precision == "fp8" else "rollout.kv_cache_dtype"
    if (r.precision != "fp8" and r.kv_cache_dtype == "auto") or not gpu_ids:
        return
    caps = query()
    if caps is None:
        logger.warning("%s: nvidia-smi did not answer, so the engines' GPUs were not checked for FP8 support"
                       " (compute capability >= 8.9)", field)
        return
    for gpu in sorted({g for engine in gpu_ids for g in engine}):
        if gpu not in caps:
            continue
        name, cap = caps[gpu]
        if cap < MIN_CAPABILITY:
            raise ConfigError(field, f"GPU {gpu} ({name}) has compute capability {cap[0]}.{cap[1]}; FP8 engines need"
                                     " 8.9 or above (FP8 tensor cores: L4, L40, H100, H200). Set rollout.precision"
                                     "=model and rollout.kv_cache_dtype=auto on this GPU")
        if cap[0] == STALE_SCALES_MAJOR and r.precision == "fp8":
            raise ConfigError(field, f"GPU {gpu} ({name}) has compute capability {cap[0]}.{cap[1]}: there SGLang"
                                     " re-quantises FP8 block scales to UE8M0 for DeepGEMM after loading, a copy"
                                     " a weight sync would leave stale (docs/fp8.md). Set rollout.precision=model")
