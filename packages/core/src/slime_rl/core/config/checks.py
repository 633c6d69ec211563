"""The cross-field checks of a config: the ones slime users learn about from a hang or a crash an
hour in (batch arithmetic, parallel sizes against the model's shape, files, URLs, placement), run
by `load_config` before anything starts."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from slime_rl.core.algorithms.registry import POLICY_LOSSES, ROLLOUT_CORRECTIONS, advantage_estimator_of
from slime_rl.core.config.backends import BACKEND_SECTIONS, section_key
from slime_rl.core.config.builtin_models import BUILTIN_PREFIX, MODEL_PATH_FIELDS
from slime_rl.core.config.memory import check_memory
from slime_rl.core.config.placement import plan_placement
from slime_rl.core.config.positions import check_positions
from slime_rl.core.config.precision import check_precision
from slime_rl.core.config.roles import check_roles
from slime_rl.core.config.schema import Config, ConfigError
from slime_rl.core.config.writable import check_writable
from slime_rl.core.infra.plugins import PluginError

FILE_SOURCES = ("jsonl", "parquet")  # the built-in data sources, which read prompt files; a user's may read anything


def read_model_shape(path: str) -> dict[str, Any] | None:
    """num_layers / heads from an HF config.json, when the model folder has one."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return None
    try:
        hf = json.loads(config_file.read_bytes())
    except json.JSONDecodeError as err:
        raise ConfigError("model.path", f"{config_file}:{err.lineno}: not valid JSON ({err.msg}); fix the file or"
                                        " give another model folder") from None
    except (UnicodeDecodeError, OSError) as err:
        raise ConfigError("model.path", f"{config_file}: cannot be read as JSON ({err}); give another model folder"
                          ) from None
    if not isinstance(hf, dict):
        raise ConfigError("model.path", f"{config_file}: holds a {type(hf).__name__}, not an HF config mapping")
    shape = {
        "num_hidden_layers": hf.get("num_hidden_layers"),
        "num_attention_heads": hf.get("num_attention_heads"),
        "num_key_value_heads": hf.get("num_key_value_heads", hf.get("num_attention_heads")),
    }
    for key, value in shape.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError("model.path", f"{config_file}: {key} is {value!r}, not a positive whole number;"
                                            " fix the file or give another model folder")
    return shape


def check_config(cfg: Config) -> None:
    """The checks slime users learn about from a hang or a crash an hour in; here, before anything starts."""
    d, t, c, p, r = cfg.data, cfg.trainer, cfg.cluster, cfg.parallel, cfg.rollout
    check_roles(cfg)  # config/roles.py: the estimator's teacher, the reward model, the folders
    samples_per_rollout = d.rollout_batch_size * d.n_samples_per_prompt
    if cfg.global_batch_size < 1:
        raise ConfigError(
            "trainer.num_steps_per_rollout",
            f"{t.num_steps_per_rollout} optimizer steps leave fewer than 1 of the {samples_per_rollout} samples"
            " per step; lower it",
        )
    if samples_per_rollout != cfg.global_batch_size * t.num_steps_per_rollout:
        raise ConfigError(
            "trainer.global_batch_size",
            f"data.rollout_batch_size * data.n_samples_per_prompt = {d.rollout_batch_size} * {d.n_samples_per_prompt}"
            f" = {samples_per_rollout} must equal trainer.global_batch_size * trainer.num_steps_per_rollout"
            f" = {cfg.global_batch_size} * {t.num_steps_per_rollout}; set global_batch_size to"
            f" {samples_per_rollout // t.num_steps_per_rollout} or leave it unset",
        )
    model_parallel = p.tensor_model_parallel_size * p.context_parallel_size * p.pipeline_model_parallel_size
    if cfg.actor_num_gpus % model_parallel:
        raise ConfigError(
            "parallel.tensor_model_parallel_size",
            f"TP * CP * PP = {p.tensor_model_parallel_size} * {p.context_parallel_size} *"
            f" {p.pipeline_model_parallel_size} must divide the trainer's"
            f" {cfg.actor_num_gpus} GPUs (cluster.actor_num_nodes * cluster.actor_num_gpus_per_node)",
        )
    if p.context_parallel_size > 1 and t.max_tokens_per_gpu is None:
        raise ConfigError("parallel.context_parallel_size",
                          "> 1 splits packed sequences; set trainer.max_tokens_per_gpu (tokens per CP rank)")
    expert_parallel = p.expert_model_parallel_size * p.expert_tensor_parallel_size * p.pipeline_model_parallel_size
    if cfg.actor_num_gpus % expert_parallel:
        raise ConfigError(
            "parallel.expert_model_parallel_size",
            f"EP * ETP * PP = {expert_parallel} must divide the trainer's {cfg.actor_num_gpus} GPUs",
        )
    if p.expert_tensor_parallel_size > 1 and p.expert_model_parallel_size == 1:
        raise ConfigError("parallel.expert_tensor_parallel_size", "> 1 needs parallel.expert_model_parallel_size > 1")
    if cfg.global_batch_size % cfg.data_parallel_size:
        raise ConfigError(
            "trainer.global_batch_size",
            f"{cfg.global_batch_size} samples do not split evenly over data-parallel size {cfg.data_parallel_size}",
        )
    if cfg.rollout_num_gpus % c.rollout_num_gpus_per_engine:
        raise ConfigError(
            "cluster.rollout_num_gpus_per_engine",
            f"the engine TP size {c.rollout_num_gpus_per_engine} must divide cluster.rollout_num_gpus"
            f" = {cfg.rollout_num_gpus}" + ("" if c.rollout_num_gpus is not None else (
                " (unset: the trainer's GPUs when colocated)" if c.colocate else "")),
        )
    if c.colocate and cfg.rollout_num_gpus > cfg.actor_num_gpus:
        raise ConfigError(
            "cluster.rollout_num_gpus",
            f"colocated engines share the trainer's {cfg.actor_num_gpus} GPUs; {cfg.rollout_num_gpus} is more."
            " Lower it or set cluster.colocate=false",
        )
    # Colocated with offload, trainer and engines take turns with the GPUs, so nothing can overlap;
    # with cluster.offload=false both stay resident on the shared GPUs and can run at once.
    if c.async_mode == "one_step" and c.colocate and c.offload is not False:
        raise ConfigError(
            "cluster.async_mode",
            "one_step async training needs separate GPUs for rollout; set cluster.colocate=false"
            " (or cluster.offload=false to share the GPUs with trainer and engines both resident)",
        )
    if c.async_mode == "fully" and c.colocate and c.offload is not False and plan_device(cfg) == "cuda":
        # On the CPU trainer and engine are separate processes anyway.
        raise ConfigError("cluster.async_mode", "fully async on GPUs needs separate GPUs for rollout;"
                                                " set cluster.colocate=false (or cluster.offload=false to share"
                                                " the GPUs with trainer and engines both resident)")
    if c.stall_fail_factor <= c.stall_warn_factor:
        raise ConfigError("cluster.stall_fail_factor", f"{c.stall_fail_factor:g} must be above"
                          f" cluster.stall_warn_factor = {c.stall_warn_factor:g}: a stalled wait warns before it fails")
    if r.over_sampling_batch_size is not None and r.over_sampling_batch_size < d.rollout_batch_size:
        raise ConfigError(
            "rollout.over_sampling_batch_size",
            f"{r.over_sampling_batch_size} is below data.rollout_batch_size = {d.rollout_batch_size}",
        )
    if t.min_lr > t.lr:
        raise ConfigError("trainer.min_lr", f"{t.min_lr:g} is above trainer.lr = {t.lr:g}; the decay floor is at most lr")
    check_algorithm(cfg)
    _check_lora(cfg)
    a = cfg.algorithm
    if a.eps_clip_c is not None and a.eps_clip_c <= 1:
        raise ConfigError("algorithm.eps_clip_c", f"dual-clip needs a value > 1, got {a.eps_clip_c}")
    if d.source in FILE_SOURCES:
        if d.prompt_data is None:
            raise ConfigError("data.prompt_data", "set it to a JSONL or Parquet file of prompts")
        if not Path(d.prompt_data).is_file():
            raise ConfigError("data.prompt_data", f"{d.prompt_data} is a directory; give the file of prompts in it"
                              if Path(d.prompt_data).is_dir() else f"file {d.prompt_data} does not exist")
    if cfg.eval.source in FILE_SOURCES:
        for name, eval_path in cfg.eval.prompt_data.items():
            if not Path(eval_path).is_file():
                raise ConfigError(f"eval.prompt_data.{name}", f"{eval_path} is a directory; give the file of prompts"
                                  " in it" if Path(eval_path).is_dir() else f"file {eval_path} does not exist")
    for dotted, folder in (("logging.dir", cfg.logging.dir), ("checkpoint.save_dir", cfg.checkpoint.save_dir)):
        if folder is not None and Path(folder).exists() and not Path(folder).is_dir():
            raise ConfigError(dotted, f"{folder} is a file; give a directory (it is created when missing)")
    check_writable(cfg)  # and HOME for a built-in model: found before anything starts, not at the first save
    if r.reward_url is not None and not is_http_url(r.reward_url):
        raise ConfigError("rollout.reward_url", f"{r.reward_url!r} is not an http(s) URL; give http://host:port/...")
    check_sandbox(cfg)
    buffer = cfg.algorithm.overlong_buffer_len
    if buffer is not None and buffer > r.max_response_len:
        raise ConfigError("algorithm.overlong_buffer_len", f"{buffer} is longer than rollout.max_response_len"
                          f" ({r.max_response_len}); DAPO penalizes the last tokens before the limit (its 20k-token"
                          " runs: 4096 of 20480)")
    check_backend_settings(cfg)
    check_precision(cfg, plan_device(cfg))  # FP8 rollouts: GPUs and an engine that serves them (config/precision.py)
    if r.tools and r.generate_fn not in ("multi_turn", "environment"):
        raise ConfigError("rollout.tools", "only the built-in agent loop calls tools; set rollout.generate_fn="
                                           "multi_turn, or drop rollout.tools")
    if (r.generate_fn == "environment") != (r.environment is not None):
        raise ConfigError("rollout.environment", "rollout.generate_fn: environment and rollout.environment go together;"
                          " name the environment (tool_math, guess_number or module:attr), or drop it")
    if r.generate_fn == "gateway" and (r.gateway.agent is None) == (not r.gateway.command):
        raise ConfigError("rollout.gateway.agent", "rollout.generate_fn: gateway runs your agent; give one of"
                          " rollout.gateway.agent (module:attr) and rollout.gateway.command")
    check_model(cfg)
    check_positions(cfg)  # samples longer than the model's positions (config/positions.py)
    check_memory(cfg)  # a model that clearly cannot fit its trainer ranks' memory (config/memory.py)
    plan_placement(cfg, device="cpu")  # refuses layouts that cannot be placed (engines across nodes)


def check_algorithm(cfg: Config) -> None:
    """The estimator and the policy loss load (a user's `module:attr` is imported and its signature
    checked), and what the estimator declares fits the rest of the config."""
    a = cfg.algorithm
    try:
        estimator = advantage_estimator_of(a)
    except PluginError as err:
        raise ConfigError("algorithm.advantage_estimator", str(err)) from None
    try:
        loss = POLICY_LOSSES.resolve(estimator.policy_loss or a.policy_loss)
    except PluginError as err:  # an estimator's implied loss is its own mistake
        raise ConfigError("algorithm.advantage_estimator" if estimator.policy_loss else "algorithm.policy_loss",
                          str(err)) from None
    if a.eps_clip_c is not None and not loss.dual_clip:
        raise ConfigError("algorithm.eps_clip_c", f"policy loss {loss.name!r} has no dual-clip; drop eps_clip_c or"
                          f" use one that has ({', '.join(e.name for e in POLICY_LOSSES if e.dual_clip)})")
    if estimator.needs_critic and a.loss_type == "sft":
        raise ConfigError("algorithm.loss_type", f"sft has no advantages; drop advantage_estimator="
                                                 f"{a.advantage_estimator} (it trains a critic)")
    check_rollout_correction(cfg)


def check_rollout_correction(cfg: Config) -> None:
    """algorithm.rollout_correction loads, and its settings mean something with the rest of the config."""
    a = cfg.algorithm
    if a.rollout_correction is None:
        if a.rollout_correction_low is not None:
            raise ConfigError("algorithm.rollout_correction_low", "is the band of a masking rollout_correction"
                              " (icepop, seq-mask-tis), and none is set; set one or drop it")
        return
    field = "algorithm.rollout_correction"
    try:
        entry = ROLLOUT_CORRECTIONS.resolve(a.rollout_correction)
    except PluginError as err:
        raise ConfigError(field, str(err)) from None
    name, high, low = entry.name, a.rollout_correction_high, a.rollout_correction_low
    if a.use_tis:
        raise ConfigError("algorithm.use_tis", f"and rollout_correction={name} are two corrections of the same"
                          " ratio; use_tis is rollout_correction: tis with rollout_correction_high: tis_clip."
                          " Keep one")
    if a.loss_type == "sft":
        raise ConfigError(field, "loss_type sft has no importance ratio to correct; drop rollout_correction")
    if a.use_rollout_logprobs:
        raise ConfigError(field, f"{name} weighs pi_old / pi_rollout, which use_rollout_logprobs makes 1 on every"
                          " token (pi_old is the engine's); drop one of them")
    if entry.masks:
        band = 1.0 / high if low is None else low
        if not band < 1.0 < high:
            raise ConfigError("algorithm.rollout_correction_low" if low is not None and high > 1 else
                              "algorithm.rollout_correction_high",
                              f"{name} keeps the tokens whose ratio lies in [rollout_correction_low,"
                              f" rollout_correction_high] = [{band:g}, {high:g}], which must hold 1 inside it (a"
                              " token the trainer and the engine agree on)" + (" (low defaults to 1 / high)"
                                                                                if low is None else ""))
    else:
        if low is not None:
            raise ConfigError("algorithm.rollout_correction_low", f"{name} truncates the weight at"
                              " rollout_correction_high and masks nothing; drop rollout_correction_low, or use a"
                              f" masking correction ({', '.join(e.name for e in ROLLOUT_CORRECTIONS if e.masks)})")
        if high < 1.0:
            raise ConfigError("algorithm.rollout_correction_high", f"{high:g} would cap even a token the trainer"
                              " and the engine agree on (ratio 1) below 1; give a cap >= 1")


def check_backend_settings(cfg: Config) -> None:
    """Each chosen backend's own checks (`BackendSettings.check`) on its section, when the config has one."""
    for name, (field, _) in BACKEND_SECTIONS.items():
        section = getattr(cfg, name)
        key = section_key(getattr(section, field))
        settings = (section.__pydantic_extra__ or {}).get(key)
        if callable(getattr(settings, "check", None)):
            settings.check(cfg, f"{name}.{key}")


def is_http_url(url: str) -> bool:
    """``url`` is http(s)://host..."""
    return urlsplit(url).scheme in ("http", "https") and bool(urlsplit(url).netloc)


def _check_lora(cfg: Config) -> None:
    """trainer.lora's reference is the base model with the adapters off; a critic trains in full."""
    if cfg.trainer.lora.rank == 0:
        if cfg.checkpoint.save_hf_merged:
            raise ConfigError("checkpoint.save_hf_merged", "merges LoRA adapters; set trainer.lora.rank or drop it")
        return
    ref = cfg.model.ref_path
    if ref is not None and ref != cfg.model.path:
        raise ConfigError("model.ref_path", f"{ref}: with trainer.lora the reference is model.path with the adapters"
                          " off (no second model); drop model.ref_path or set trainer.lora.rank=0")
    if advantage_estimator_of(cfg.algorithm).needs_critic:
        raise ConfigError("trainer.lora", f"the critic of advantage_estimator={cfg.algorithm.advantage_estimator} has"
                          " no adapters; use a critic-free estimator (grpo, rloo, ...) or trainer.lora.rank=0")


def plan_device(cfg: Config) -> str:
    """The device a run will use (cluster.device, auto resolved on this machine)."""
    from slime_rl.core.config.device import resolve_device

    return resolve_device(cfg.cluster.device)


def check_model(cfg: Config) -> None:
    """The model folders exist, and the parallel sizes fit the model's heads and layers (read from its
    config.json). A ``builtin:`` model is checked once resolved (builtin_models.resolve_model_paths)."""
    for key in MODEL_PATH_FIELDS:
        folder = getattr(cfg.model, key)
        if folder is not None and not folder.startswith(BUILTIN_PREFIX) and not Path(folder).exists():
            raise ConfigError(f"model.{key}", f"{folder} does not exist (no model hub here: give a local HF folder)")
        if key != "tokenizer_path" and folder is not None and Path(folder).is_file():
            raise ConfigError(f"model.{key}", f"{folder} is a file; give the Hugging Face folder it is in")
    path = cfg.model.path
    if path.startswith(BUILTIN_PREFIX):
        return
    shape = read_model_shape(path)
    if shape is None:
        return
    tp, pp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    heads, kv_heads, layers = shape["num_attention_heads"], shape["num_key_value_heads"], shape["num_hidden_layers"]
    if heads and heads % tp:
        raise ConfigError("parallel.tensor_model_parallel_size", f"{tp} must divide the model's {heads} attention heads")
    if kv_heads and kv_heads % tp and tp % kv_heads:
        raise ConfigError(
            "parallel.tensor_model_parallel_size", f"{tp} and the model's {kv_heads} KV heads must divide one another"
        )
    if layers and layers % pp:
        raise ConfigError("parallel.pipeline_model_parallel_size", f"{pp} must divide the model's {layers} layers")
    engine_tp = cfg.cluster.rollout_num_gpus_per_engine
    if heads and heads % engine_tp:
        raise ConfigError("cluster.rollout_num_gpus_per_engine", f"engine TP {engine_tp} must divide {heads} heads")


def check_sandbox(cfg: Config) -> None:
    """rollout.sandbox: its interpreter and paths exist; require_isolation holds on this machine."""
    sb = cfg.rollout.sandbox
    if sb.python is not None and not (os.path.isabs(sb.python) and os.access(sb.python, os.X_OK)):
        raise ConfigError("rollout.sandbox.python", f"{sb.python} is not an executable file; give the absolute path"
                                                    " of a Python interpreter, or leave it unset")
    for path in sb.readonly_paths:
        if not os.path.isabs(path) or not os.path.exists(path):
            raise ConfigError("rollout.sandbox.readonly_paths", f"{path} is not an existing absolute path")
    if sb.require_isolation:
        from slime_rl.core.sandbox.isolation import require_isolation_error  # probes the kernel once

        if error := require_isolation_error():
            raise ConfigError("rollout.sandbox.require_isolation", error)
