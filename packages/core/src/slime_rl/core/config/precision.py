"""``rollout.precision`` and ``rollout.kv_cache_dtype`` against what would serve them (docs/fp8.md): FP8 needs
GPUs and an engine that declares it serves FP8 (its settings' ``serves_fp8``; SGLang's does). Checked before
anything starts; an engine on a GPU below compute capability 8.9 refuses at its start (the plan cannot see
the GPUs it will get)."""

from __future__ import annotations

import json
from pathlib import Path

from slime_rl.core.config.backends import BACKEND_SECTIONS, settings_model
from slime_rl.core.config.schema import Config, ConfigError
from slime_rl.core.infra.plugins import PluginError


def fp8_asked(cfg: Config) -> str | None:
    """The field that asks for FP8 (weights first), or None."""
    if cfg.rollout.precision == "fp8":
        return "rollout.precision"
    return "rollout.kv_cache_dtype" if cfg.rollout.kv_cache_dtype != "auto" else None


def check_precision(cfg: Config, device: str) -> None:
    """Refuse FP8 on a device or engine that cannot serve it, and with options that do not go with it yet;
    ``device`` is the run's (cluster.device resolved)."""
    field = fp8_asked(cfg)
    if field is None:
        return
    r = cfg.rollout
    undo = "set rollout.precision=model and rollout.kv_cache_dtype=auto"
    if device != "cuda":
        raise ConfigError(field, f"FP8 rollouts need GPUs of compute capability 8.9 or above (L4, L40, H100, H200);"
                                 f" this run's device is {device} (cluster.device={cfg.cluster.device}): {undo}")
    try:
        settings = settings_model(BACKEND_SECTIONS["rollout"][1], r.engine)
    except PluginError:
        return  # an engine that does not load is refused by its own check, naming rollout.engine
    if not getattr(settings, "serves_fp8", False):
        raise ConfigError(field, f"rollout.engine={r.engine} serves weights and KV cache in the model's dtype only"
                                 " (FP8 needs SGLang's FP8 kernels): use rollout.engine=sglang, or " + undo)
    if r.precision == "fp8" and r.update_weight_mode == "delta":
        raise ConfigError("rollout.update_weight_mode", "delta syncs send changes of the trainer's dtype, and FP8"
                                                        " engines load whole (weight, scale) pairs; set"
                                                        " rollout.update_weight_mode=full with rollout.precision=fp8")
    if r.precision == "fp8":
        _check_blocks(cfg)


def _check_blocks(cfg: Config) -> None:
    """The model's FP8 blocks, when its config.json is here (a ``builtin:`` model is checked once resolved, at
    the engine's start like any other): an already quantised model, or one no block edge divides, is refused."""
    from slime_rl.core.weights.fp8 import BLOCK_EDGES, block_edge, model_partitions

    path = Path(cfg.model.path) / "config.json"
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError):
        return  # no such folder yet, or not JSON: check_model says which
    if not isinstance(hf, dict):
        return
    if "quantization_config" in hf:
        raise ConfigError("rollout.precision", f"{path} is already quantised: rollout.precision=fp8 serves FP8"
                                               " copies of a model the trainer holds in bf16 or fp32; give that"
                                               " model, or set rollout.precision=model")
    tp = cfg.cluster.rollout_num_gpus_per_engine
    try:
        partitions = model_partitions(hf, tp)
    except (KeyError, TypeError, ZeroDivisionError):
        return  # not a decoder config this knows (a VL model's text_config): the engine's start says so
    if block_edge(partitions) is None:
        raise ConfigError("rollout.precision", f"no FP8 block edge of {', '.join(map(str, BLOCK_EDGES))} divides"
                                               f" the model's partitions {partitions} at engine TP {tp}; set"
                                               " rollout.precision=model")
