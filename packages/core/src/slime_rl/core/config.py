"""The config tree: YAML in, dotted ``key=value`` overrides, checked before anything starts.

Field names and defaults follow slime's flags (``--rollout-batch-size`` is
``data.rollout_batch_size`` here, ``--eps-clip-high`` is ``algorithm.eps_clip_high``).
Every error is a :class:`ConfigError` whose message names the field and the fix.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class ConfigError(ValueError):
    """A config mistake. ``str(err)`` is one line: ``<field>: <what is wrong and the fix>``."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)


class ModelConfig(_Section):
    path: str = "builtin:smollm2-135m-instruct"  # an HF folder, or "builtin:smollm2-135m-instruct"
    tokenizer_path: str | None = None  # defaults to path
    ref_path: str | None = None  # reference model; defaults to path
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: fp32 on CPU, bf16 on GPU


class DataConfig(_Section):
    source: str = "jsonl"  # data source plugin name or module:attr
    prompt_data: str | None = None  # JSONL or Parquet file of prompts
    input_key: str = "input"
    label_key: str | None = "label"
    metadata_key: str | None = "metadata"
    tools_key: str | None = "tools"
    apply_chat_template: bool = False
    rollout_batch_size: int = Field(32, ge=1)  # prompts per rollout step
    n_samples_per_prompt: int = Field(8, ge=1)  # samples per prompt (one group)
    num_rollout: int | None = Field(None, ge=1)  # rollout steps; default: num_epoch passes over the data
    num_epoch: int = Field(1, ge=1)
    shuffle: bool = True
    seed: int = 42
    skip_bad_lines: bool = False


class RolloutConfig(_Section):
    engine: str = "hf"  # rollout engine plugin name or module:attr
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    max_prompt_len: int | None = Field(None, ge=1)  # longer prompts are refused by the data source
    max_response_len: int = Field(1024, ge=1)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    over_sampling_batch_size: int | None = Field(None, ge=1)  # prompts submitted per refill; >= rollout_batch_size
    dynamic_sampling_filter: str | None = None  # "nonzero_std" (DAPO) or module:attr
    partial_rollout: bool = False  # aborted groups go back to the buffer with their tokens
    generate_fn: str | None = None  # module:attr, replaces single-turn generation
    reward: str = "math"  # built-in reward name or module:attr
    group_reward: bool = False  # the reward takes a whole group
    reward_key: str | None = None  # for dict rewards
    reward_url: str | None = None  # the `remote` reward POSTs each sample here (slime: --rm-url)
    reward_timeout: float = Field(30.0, gt=0)  # seconds per reward call
    reward_concurrency: int = Field(64, ge=1)
    on_reward_failure: Literal["zero", "drop"] = "zero"
    max_concurrency: int = Field(512, ge=1)  # in-flight generate requests
    engine_urls: list[str] = Field(default_factory=list)  # attach to running servers instead of launching
    engine_python: str | None = None  # interpreter to launch servers with (SGLang in its own env)
    engine_args: dict[str, Any] = Field(default_factory=dict)  # passed through to the engine (e.g. SGLang server flags)
    router_policy: str = "round_robin"
    engine_startup_timeout: float = Field(900.0, gt=0)  # seconds for a launched server to answer /health
    weight_sync_timeout: float = Field(600.0, gt=0)  # seconds per weight-sync step (a bucket, a pause, a flush)
    update_weight_transport: Literal["auto", "tensor", "nccl", "disk"] = "auto"
    update_weight_buffer_mb: int = Field(512, ge=1)
    check_weight_update: bool = False  # after each sync, compare engine weights with the trainer's (slow)
    max_staleness: int | None = Field(None, ge=0)  # async: samples older than this many versions are stale
    staleness_policy: Literal["drop", "downweight"] = "drop"  # what happens to stale samples
    buffer_filter: str | None = None  # which buffered groups to hand out: "oldest_first", "freshest_first", module:attr


class AlgorithmConfig(_Section):
    advantage_estimator: Literal[
        "grpo", "dr_grpo", "gspo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"
    ] = "grpo"
    loss_type: Literal["policy", "sft"] = "policy"
    policy_loss: Literal["ppo", "gspo", "cispo"] = "ppo"
    grpo_std_normalization: bool = True  # off automatically when n_samples_per_prompt == 1
    normalize_advantages: bool = False  # batch whitening
    gamma: float = 1.0
    lambd: float = 1.0
    eps_clip: float = Field(0.2, gt=0)
    eps_clip_high: float | None = None  # defaults to eps_clip
    eps_clip_c: float | None = None  # dual-clip, > 1
    use_tis: bool = False
    tis_clip: float = Field(2.0, gt=0)
    kl_coef: float = 0.0  # KL as a reward penalty
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = "low_var_kl"
    entropy_coef: float = 0.0
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    value_clip: float = 0.2
    use_rollout_logprobs: bool = False  # use the engine's log-probs as the old policy


SELECTIVE_RECOMPUTE_MODULES = ("core_attn", "mlp")  # Megatron's recompute_modules the local spec supports


class TrainerConfig(_Section):
    backend: str = "megatron"  # trainer plugin name or module:attr
    global_batch_size: int | None = Field(None, ge=1)  # samples per optimizer step; derived when unset
    num_steps_per_rollout: int = Field(1, ge=1)
    micro_batch_size: int = Field(1, ge=1)
    max_tokens_per_gpu: int | None = Field(None, ge=1)  # dynamic micro-batching by a token budget
    lr: float = Field(1e-6, gt=0)
    min_lr: float = 0.0
    lr_warmup_steps: int = Field(0, ge=0)
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    seed: int = 1234
    # true: full activation recompute; a list: Megatron's selective recompute of those modules
    recompute: bool | list[str] = False
    critic_lr: float | None = None  # PPO critic; defaults to lr
    on_nonfinite: Literal["skip", "stop"] = "skip"  # a step whose loss or gradient is nan/inf: skip it, or fail

    @field_validator("recompute", mode="before")
    @classmethod
    def _recompute_modules(cls, value: Any) -> Any:
        if isinstance(value, list | tuple):
            unknown = [m for m in value if m not in SELECTIVE_RECOMPUTE_MODULES]
            if unknown or not value:
                raise ValueError(
                    f"{unknown or value!r}: give true (full recompute) or a list of {', '.join(SELECTIVE_RECOMPUTE_MODULES)}"
                    " (Megatron's layernorm recompute needs TransformerEngine, which the local spec does not use)")
            return list(value)
        return value


class ParallelConfig(_Section):
    tensor_model_parallel_size: int = Field(1, ge=1)
    pipeline_model_parallel_size: int = Field(1, ge=1)
    sequence_parallel: bool = False


class ClusterConfig(_Section):
    device: Literal["auto", "cpu", "cuda"] = "auto"
    actor_num_nodes: int = Field(1, ge=1)
    actor_num_gpus_per_node: int = Field(1, ge=1)  # trainer ranks per node (processes on CPU)
    rollout_num_gpus: int | None = Field(None, ge=1)  # defaults: the actor's GPUs when colocated
    rollout_num_gpus_per_engine: int = Field(1, ge=1)  # the engine's tensor-parallel size
    num_gpus_per_node: int | None = Field(None, ge=1)  # node size, for placement; default max(8, actor's per node)
    colocate: bool = True
    async_train: bool = Field(False, alias="async")  # one-step-off: generate k+1 while training k
    offload: bool | None = None  # colocated: hand the GPUs back and forth between phases; unset: on when colocated
    num_cpus: int | None = None  # for the local Ray instance


class EvalConfig(_Section):
    interval: int | None = Field(None, ge=1)  # rollout steps between evals; None: only before and after
    prompt_data: dict[str, str] = Field(default_factory=dict)  # eval set name -> file
    n_samples_per_prompt: int = Field(1, ge=1)
    temperature: float = 0.0  # 0: greedy
    max_response_len: int | None = None  # defaults to rollout.max_response_len


class CheckpointConfig(_Section):
    save_dir: str | None = None  # default: <logging.dir>/checkpoints
    save_interval: int | None = Field(None, ge=1)
    resume: bool = False  # continue from the newest checkpoint in save_dir
    save_hf: bool = False  # also write an HF folder with every checkpoint
    keep_last: int | None = Field(None, ge=1)


class LoggingConfig(_Section):
    dir: str = "runs/latest"
    tensorboard: bool = True
    wandb_project: str | None = None
    progress_bar: bool = True
    save_rollouts: bool = False  # every step's samples to <dir>/rollouts/step_<k>.jsonl (for debugging)


class Config(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)

    # Derived values: read these, never the raw optional fields.
    @property
    def global_batch_size(self) -> int:
        if self.trainer.global_batch_size is not None:
            return self.trainer.global_batch_size
        return self.data.rollout_batch_size * self.data.n_samples_per_prompt // self.trainer.num_steps_per_rollout

    @property
    def eps_clip_high(self) -> float:
        return self.algorithm.eps_clip_high if self.algorithm.eps_clip_high is not None else self.algorithm.eps_clip

    @property
    def over_sampling_batch_size(self) -> int:
        return self.rollout.over_sampling_batch_size or self.data.rollout_batch_size

    @property
    def actor_num_gpus(self) -> int:
        return self.cluster.actor_num_nodes * self.cluster.actor_num_gpus_per_node

    @property
    def rollout_num_gpus(self) -> int:
        if self.cluster.rollout_num_gpus is not None:
            return self.cluster.rollout_num_gpus
        return self.actor_num_gpus if self.cluster.colocate else self.cluster.rollout_num_gpus_per_engine

    @property
    def num_gpus_per_node(self) -> int:
        c = self.cluster
        return c.num_gpus_per_node if c.num_gpus_per_node is not None else max(8, c.actor_num_gpus_per_node)

    @property
    def offload(self) -> bool:
        """Colocated phases hand the GPUs back and forth; on unless cluster.offload says no
        (slime: --colocate turns on --offload). Disaggregated runs never offload."""
        return self.cluster.colocate and self.cluster.offload is not False

    @property
    def num_engines(self) -> int:
        return self.rollout_num_gpus // self.cluster.rollout_num_gpus_per_engine

    @property
    def checkpoint_dir(self) -> Path:
        """checkpoint.save_dir, or ``<logging.dir>/checkpoints``."""
        return Path(self.checkpoint.save_dir or Path(self.logging.dir) / "checkpoints")

    @property
    def data_parallel_size(self) -> int:
        p = self.parallel
        return self.actor_num_gpus // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# ---------------------------------------------------------------- loading


def _section_fields(model: type[BaseModel]) -> dict[str, Any]:
    """Accepted keys of a section (aliases included) -> field info."""
    out = {}
    for name, info in model.model_fields.items():
        out[info.alias or name] = info
        out[name] = info
    return out


def _check_keys(data: Any, model: type[BaseModel], prefix: str) -> None:
    """Refuse unknown keys, naming the nearest valid one."""
    if not isinstance(data, dict):
        raise ConfigError(prefix or "config", f"expected a mapping, got {type(data).__name__}")
    fields = _section_fields(model)
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
            hint = f"did you mean `{prefix + '.' if prefix else ''}{close[0]}`?" if close else (
                f"valid keys here: {', '.join(sorted(set(fields)))}")
            raise ConfigError(dotted, f"unknown key; {hint}")
        annotation = fields[key].annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            _check_keys(value, annotation, dotted)


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(dotted, f"`{part}` is a value, not a section")
        node = child
    node[parts[-1]] = value


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """``["rollout.temperature=0.7", "eval.prompt_data={a: x.jsonl}"]`` -> nested dict (values parsed as YAML)."""
    tree: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(item, "an override is `section.key=value`")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as err:
            raise ConfigError(key, f"cannot parse value {raw!r}: {err}") from None
        _set_dotted(tree, key.strip(), value)
    return tree


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, *, check: bool = True) -> Config:
    """Read YAML (or nothing: the CPU default), apply overrides, validate, and run the cross-field checks."""
    data: dict[str, Any] = {}
    base_dir = Path.cwd()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError("config", f"file {path} does not exist")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(str(path), f"is not valid YAML: {err}".replace("\n", " ")) from None
        if not isinstance(data, dict):
            raise ConfigError(str(path), f"expected a mapping of sections (model:, data:, ...), got {type(data).__name__}")
        base_dir = path.parent
    data = _merge(data, parse_overrides(overrides or []))
    _check_keys(data, Config, "")
    try:
        cfg = Config.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise ConfigError(loc or "config", f"{first['msg']} (got {first.get('input')!r})") from None
    _resolve_paths(cfg, base_dir)
    if check:
        check_config(cfg)
    return cfg


def _resolve_paths(cfg: Config, base_dir: Path) -> None:
    """Relative file paths in a config file are relative to that file."""

    def fix(p: str | None) -> str | None:
        if p is None or p.startswith("builtin:") or Path(p).is_absolute() or ":" in p.split("/")[0]:
            return p
        candidate = base_dir / p
        return str(candidate) if candidate.exists() or not Path(p).exists() else p

    cfg.data.prompt_data = fix(cfg.data.prompt_data)
    cfg.model.path = fix(cfg.model.path) or cfg.model.path
    cfg.model.tokenizer_path = fix(cfg.model.tokenizer_path)
    cfg.model.ref_path = fix(cfg.model.ref_path)
    cfg.eval.prompt_data = {name: fix(p) or p for name, p in cfg.eval.prompt_data.items()}


# ---------------------------------------------------------------- cross-field checks


def read_model_shape(path: str) -> dict[str, Any] | None:
    """num_layers / heads from an HF config.json, when the model folder has one."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return None
    hf = json.loads(config_file.read_text())
    return {
        "num_hidden_layers": hf.get("num_hidden_layers"),
        "num_attention_heads": hf.get("num_attention_heads"),
        "num_key_value_heads": hf.get("num_key_value_heads", hf.get("num_attention_heads")),
    }


def check_config(cfg: Config) -> None:
    """The checks slime users learn about from a hang or a crash an hour in; here, before anything starts."""
    d, t, c, p, r = cfg.data, cfg.trainer, cfg.cluster, cfg.parallel, cfg.rollout
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
    model_parallel = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
    if cfg.actor_num_gpus % model_parallel:
        raise ConfigError(
            "parallel.tensor_model_parallel_size",
            f"TP * PP = {p.tensor_model_parallel_size} * {p.pipeline_model_parallel_size} must divide the trainer's"
            f" {cfg.actor_num_gpus} GPUs (cluster.actor_num_nodes * cluster.actor_num_gpus_per_node)",
        )
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
    if c.async_train and c.colocate:
        raise ConfigError(
            "cluster.async",
            "one-step-off async training needs separate GPUs for rollout; set cluster.colocate=false",
        )
    if r.over_sampling_batch_size is not None and r.over_sampling_batch_size < d.rollout_batch_size:
        raise ConfigError(
            "rollout.over_sampling_batch_size",
            f"{r.over_sampling_batch_size} is below data.rollout_batch_size = {d.rollout_batch_size}",
        )
    a = cfg.algorithm
    if a.eps_clip_c is not None and a.eps_clip_c <= 1:
        raise ConfigError("algorithm.eps_clip_c", f"dual-clip needs a value > 1, got {a.eps_clip_c}")
    if a.advantage_estimator == "ppo" and a.loss_type == "sft":
        raise ConfigError("algorithm.loss_type", "sft has no advantages; drop advantage_estimator=ppo")
    if d.source in ("jsonl", "parquet"):
        if d.prompt_data is None:
            raise ConfigError("data.prompt_data", "set it to a JSONL or Parquet file of prompts")
        if not Path(d.prompt_data).is_file():
            raise ConfigError("data.prompt_data", f"file {d.prompt_data} does not exist")
    for name, eval_path in cfg.eval.prompt_data.items():
        if not Path(eval_path).is_file():
            raise ConfigError(f"eval.prompt_data.{name}", f"file {eval_path} does not exist")
    _check_model(cfg)
    from slime_rl.core.placement import plan_placement  # here: placement imports this module

    plan_placement(cfg, device="cpu")  # refuses layouts that cannot be placed (engines across nodes)


def _check_model(cfg: Config) -> None:
    path = cfg.model.path
    if path.startswith("builtin:"):
        return
    if not Path(path).exists():
        raise ConfigError("model.path", f"{path} does not exist (no model hub here: give a local HF folder)")
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
