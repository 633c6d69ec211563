"""The config tree: YAML in, dotted ``key=value`` overrides, checked before anything starts.

Field names and defaults follow slime's flags (``--rollout-batch-size`` is
``data.rollout_batch_size`` here, ``--eps-clip-high`` is ``algorithm.eps_clip_high``).
Every error is a :class:`ConfigError` whose message names the field and the fix.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import reprlib
import shutil
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator


class ConfigError(ValueError):
    """A config mistake. ``str(err)`` is one line: ``<field>: <what is wrong and the fix>``."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")

    def __reduce__(self):  # pickle (Ray) rebuilds it from both arguments, not from the joined message
        return type(self), (self.field, self.message), self.__dict__


class RunFailedError(RuntimeError):
    """A run stopped at run time for the reason its one-line message gives (``<field>: <what
    happened and the fix>``, e.g. too many failed rewards); not a bug, so no traceback, exit 1."""


class _Section(BaseModel):
    # strict: `true` is not a batch size, "yes" is not a boolean, 3.5 is not an int (an int is a float);
    # allow_inf_nan: no field of a config means anything at .inf or .nan
    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True, strict=True,
                              allow_inf_nan=False)


SEED_MAX = 2**32 - 1  # numpy, Megatron and SGLang all take 32-bit seeds


def _off_or_positive(value: int) -> int:
    """top_k: -1 (off) or at least 1."""
    if value != -1 and value < 1:
        raise ValueError(f"give -1 (off) or a value >= 1, got {value}")
    return value


class ModelConfig(_Section):
    path: str = "builtin:smollm2-135m-instruct"  # an HF folder, or "builtin:smollm2-135m-instruct"
    tokenizer_path: str | None = None  # defaults to path
    ref_path: str | None = None  # reference model; defaults to path
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bf16 on GPU; on CPU per core.cpu


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
    seed: int = Field(42, ge=0, le=SEED_MAX)
    skip_bad_lines: bool = False


class RolloutConfig(_Section):
    engine: str = "hf"  # rollout engine plugin name or module:attr
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: Annotated[int, AfterValidator(_off_or_positive)] = -1  # -1: off
    max_prompt_len: int | None = Field(None, ge=1)  # longer prompts are refused by the data source
    max_response_len: int = Field(1024, ge=1)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
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
    reward_workers: int | None = Field(None, ge=0)  # processes running module:attr rewards/filters; 0: in process
    max_failed_fraction: float = Field(0.5, ge=0.0, le=1.0)  # a step fails when more of its samples failed
    max_failed_steps: int = Field(3, ge=1)  # this many failed steps in a row fail the run
    loop_block_warn_s: float = Field(10.0, gt=0)  # report when the rollout's event loop is blocked this long
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
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    lambd: float = Field(1.0, ge=0.0, le=1.0)
    eps_clip: float = Field(0.2, gt=0)
    eps_clip_high: float | None = Field(None, gt=0)  # defaults to eps_clip
    eps_clip_c: float | None = None  # dual-clip, > 1
    use_tis: bool = False
    tis_clip: float = Field(2.0, gt=0)
    kl_coef: float = Field(0.0, ge=0.0)  # KL as a reward penalty
    use_kl_loss: bool = False
    kl_loss_coef: float = Field(0.0, ge=0.0)
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = "low_var_kl"
    entropy_coef: float = Field(0.0, ge=0.0)
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    value_clip: float = Field(0.2, gt=0.0)
    use_rollout_logprobs: bool = False  # use the engine's log-probs as the old policy


SELECTIVE_RECOMPUTE_MODULES = ("core_attn", "mlp")  # Megatron's recompute_modules the local spec supports


class TrainerConfig(_Section):
    backend: str = "megatron"  # trainer plugin name or module:attr
    global_batch_size: int | None = Field(None, ge=1)  # samples per optimizer step; derived when unset
    num_steps_per_rollout: int = Field(1, ge=1)
    micro_batch_size: int = Field(1, ge=1)
    max_tokens_per_gpu: int | None = Field(None, ge=1)  # dynamic micro-batching by a token budget
    lr: float = Field(1e-6, gt=0)
    min_lr: float = Field(0.0, ge=0.0)  # <= lr
    lr_warmup_steps: int = Field(0, ge=0)
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    weight_decay: float = Field(0.0, ge=0.0)
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0)
    adam_beta2: float = Field(0.98, ge=0.0, lt=1.0)
    adam_eps: float = Field(1e-8, gt=0.0)
    clip_grad: float = Field(1.0, ge=0.0)  # 0: no clipping (Megatron)
    seed: int = Field(1234, ge=0, le=SEED_MAX)
    # true: full activation recompute; a list: Megatron's selective recompute of those modules
    recompute: bool | list[str] = False
    critic_lr: float | None = Field(None, gt=0)  # PPO critic; defaults to lr
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
    num_cpus: int | None = Field(None, ge=1)  # for the local Ray instance


class EvalConfig(_Section):
    interval: int | None = Field(None, ge=1)  # rollout steps between evals; None: only before and after
    prompt_data: dict[str, str] = Field(default_factory=dict)  # eval set name -> file
    n_samples_per_prompt: int = Field(1, ge=1)
    temperature: float = Field(0.0, ge=0.0)  # 0: greedy
    max_response_len: int | None = Field(None, ge=1)  # defaults to rollout.max_response_len


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


MAX_CONFIG_BYTES = 1 << 20  # a config is a few KB; a bigger file is the wrong file
MAX_YAML_VALUES = 100_000  # values once aliases are expanded: a 300-byte alias bomb expands to billions
MAX_YAML_DEPTH = 64  # nesting; an alias that refers to itself nests forever


class _ConfigLoader(yaml.SafeLoader):
    """SafeLoader that reads `1e-6` as a number, as YAML 1.2 does (YAML 1.1 makes it a string), and stops at
    deep `[[[...` nesting as soon as it sees it (PyYAML's scanner is quadratic in it)."""

    def fetch_flow_collection_start(self, TokenClass: Any) -> None:
        if self.flow_level >= MAX_YAML_DEPTH:
            raise yaml.scanner.ScannerError(None, None, f"nests deeper than {MAX_YAML_DEPTH} levels", self.get_mark())
        super().fetch_flow_collection_start(TokenClass)


_ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                  |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                  |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                  |[-+]?\.(?:inf|Inf|INF)
                  |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."),
)


def parse_yaml(text: str, where: str, *, in_file: bool = False) -> Any:
    """YAML text -> plain values, bounded: no more than MAX_YAML_VALUES values once aliases are expanded and
    no deeper than MAX_YAML_DEPTH, so a small bomb is refused at once instead of filling memory later
    (validation, error messages and `plan` all walk the expanded tree). ``where`` names the source in errors;
    ``in_file``: it is a file, and a syntax error is named at its ``file:line``."""
    try:
        value = yaml.load(text, Loader=_ConfigLoader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        problem = getattr(err, "problem", None) or str(err)
        at = f"{where}:{mark.line + 1}" if mark is not None and in_file else where
        raise ConfigError(at, f"is not valid YAML: {' '.join(str(problem).split())}; fix the syntax") from None
    except RecursionError:
        raise ConfigError(where, f"nests deeper than {MAX_YAML_DEPTH} levels; a config needs a few") from None
    count, stack = 0, [(value, 0)] if isinstance(value, dict | list) else []
    while stack:  # walk the containers, counting their values
        node, depth = stack.pop()
        if depth > MAX_YAML_DEPTH:
            raise ConfigError(where, f"nests deeper than {MAX_YAML_DEPTH} levels (or a YAML alias refers to itself);"
                                     " a config needs a few")
        children = list(node.values()) if isinstance(node, dict) else node
        count += len(children)
        if count > MAX_YAML_VALUES:
            raise ConfigError(where, f"holds more than {MAX_YAML_VALUES} values once its YAML aliases are expanded;"
                                     " a config needs far fewer (an alias bomb?): remove the aliases")
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return value


def _read_config_file(path: Path) -> dict[str, Any]:
    """A YAML config file -> its mapping; every way it can be unreadable is a one-line ConfigError."""
    if path.is_dir():
        raise ConfigError("config", f"{path} is a directory; give the YAML file in it")
    if not path.is_file():
        raise ConfigError("config", f"file {path} does not exist")
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ConfigError(str(path), f"is {size} bytes, more than a config's {MAX_CONFIG_BYTES}; is it the right file?")
        raw = path.read_bytes()
    except OSError as err:
        raise ConfigError(str(path), f"cannot be read: {err.strerror or err}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = raw[:err.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}", f"is not UTF-8 text (byte 0x{raw[err.start]:02x}); save the file as"
                                            " UTF-8") from None
    data = parse_yaml(text, str(path), in_file=True) or {}
    if not isinstance(data, dict):
        raise ConfigError(str(path), f"expected a mapping of sections (model:, data:, ...), got {type(data).__name__}")
    return data


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
        value = parse_yaml(raw, key.strip()) if raw != "" else ""
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
        data = _read_config_file(path)
        base_dir = path.parent
    data = _merge(data, parse_overrides(overrides or []))
    _check_keys(data, Config, "")
    try:
        cfg = Config.model_validate(data)
    except ValidationError as err:
        raise _field_error(err) from None
    _resolve_paths(cfg, base_dir)
    if check:
        check_config(cfg)
    return cfg


# pydantic's type errors, said as what to give instead
_TYPE_ERRORS = {
    "int_type": "must be a whole number",
    "float_type": "must be a number",
    "bool_type": "must be true or false",
    "string_type": "must be a string (quote it)",
    "finite_number": "must be a finite number (not .inf or .nan)",
    "list_type": "must be a list",
    "dict_type": "must be a mapping",
}
_UNION_TAG = re.compile(r"int|float|bool|str|none|(list|dict|literal)\[.*\]|function-.*|\[key\]")


def _field_error(err: ValidationError) -> ConfigError:
    """pydantic's first error as one line: the dotted field, what is wrong, what it got (shortened)."""
    first = err.errors(include_url=False)[0]
    # drop the union-member tags pydantic puts in the location (`bool`, `list[str]`, `function-after[...]`)
    loc = ".".join(str(p) for p in first["loc"] if not _UNION_TAG.fullmatch(str(p)))
    value = first.get("input")
    if first["type"] == "value_error":  # our validators' messages say it all, the value included
        return ConfigError(loc or "config", first["msg"].removeprefix("Value error, "))
    message = _TYPE_ERRORS.get(first["type"]) or first["msg"].replace("Input should be", "must be")
    got = (str(value).lower() + ", a boolean") if isinstance(value, bool) else reprlib.repr(value)
    return ConfigError(loc or "config", f"{message} (got {got})")


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
    if t.min_lr > t.lr:
        raise ConfigError("trainer.min_lr", f"{t.min_lr:g} is above trainer.lr = {t.lr:g}; the decay floor is at most lr")
    a = cfg.algorithm
    if a.eps_clip_c is not None and a.eps_clip_c <= 1:
        raise ConfigError("algorithm.eps_clip_c", f"dual-clip needs a value > 1, got {a.eps_clip_c}")
    if a.advantage_estimator == "ppo" and a.loss_type == "sft":
        raise ConfigError("algorithm.loss_type", "sft has no advantages; drop advantage_estimator=ppo")
    if d.source in ("jsonl", "parquet"):
        if d.prompt_data is None:
            raise ConfigError("data.prompt_data", "set it to a JSONL or Parquet file of prompts")
        if not Path(d.prompt_data).is_file():
            raise ConfigError("data.prompt_data", f"{d.prompt_data} is a directory; give the file of prompts in it"
                              if Path(d.prompt_data).is_dir() else f"file {d.prompt_data} does not exist")
    for name, eval_path in cfg.eval.prompt_data.items():
        if not Path(eval_path).is_file():
            raise ConfigError(f"eval.prompt_data.{name}", f"{eval_path} is a directory; give the file of prompts in it"
                              if Path(eval_path).is_dir() else f"file {eval_path} does not exist")
    for dotted, folder in (("logging.dir", cfg.logging.dir), ("checkpoint.save_dir", cfg.checkpoint.save_dir)):
        if folder is not None and Path(folder).exists() and not Path(folder).is_dir():
            raise ConfigError(dotted, f"{folder} is a file; give a directory (it is created when missing)")
    for dotted, url in [("rollout.reward_url", r.reward_url)] + [("rollout.engine_urls", u) for u in r.engine_urls]:
        if url is not None and (urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).netloc):
            raise ConfigError(dotted, f"{url!r} is not an http(s) URL; give http://host:port/...")
    if r.engine_python is not None and not (os.access(r.engine_python, os.X_OK) if os.sep in r.engine_python
                                            else shutil.which(r.engine_python)):
        raise ConfigError("rollout.engine_python", f"{r.engine_python} is not an executable interpreter;"
                                                   " give the python of SGLang's environment")
    _check_model(cfg)
    from slime_rl.core.placement import plan_placement  # here: placement imports this module

    plan_placement(cfg, device="cpu")  # refuses layouts that cannot be placed (engines across nodes)


def _check_model(cfg: Config) -> None:
    for key in ("path", "tokenizer_path", "ref_path"):
        folder = getattr(cfg.model, key)
        if folder is not None and not folder.startswith("builtin:") and not Path(folder).exists():
            raise ConfigError(f"model.{key}", f"{folder} does not exist (no model hub here: give a local HF folder)")
        if key != "tokenizer_path" and folder is not None and Path(folder).is_file():
            raise ConfigError(f"model.{key}", f"{folder} is a file; give the Hugging Face folder it is in")
    path = cfg.model.path
    if path.startswith("builtin:"):
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
