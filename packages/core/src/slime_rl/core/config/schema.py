"""The config tree: its sections, fields, defaults and derived values, and the errors a config raises.

Field names and defaults follow slime's flags (``--rollout-batch-size`` is
``data.rollout_batch_size`` here, ``--eps-clip-high`` is ``algorithm.eps_clip_high``).
Every error is a :class:`ConfigError` whose message names the field and the fix.
Import these names from ``slime_rl.core.config``; only the modules the config's own checks
import (placement) import this one, so that the checks need not import them lazily.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    field_validator,
    model_validator,
)

from slime_rl.core.algorithms.registry import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, ROLLOUT_CORRECTIONS
from slime_rl.core.config.backends import BACKEND_SECTIONS, section_key, settings_model, validate_sections
from slime_rl.core.config.errors import ConfigError
from slime_rl.core.config.renamed import move_renamed_keys
from slime_rl.core.config.roles import RoleConfig
from slime_rl.core.config.secrets import Secret, remember_url, serialize_url
from slime_rl.core.infra.plugins import PluginError


class CheckpointError(ConfigError):
    """A checkpoint that cannot be resumed from. ``str(err)`` is one line: ``<file>: <what is wrong and the way on>``.

    Here, below both modules that raise it: run/checkpoint.py (folders and checksums) and
    infra/safe_pickle.py (what the pickles in them may hold), which the Megatron trainer also calls."""

    def __reduce__(self) -> tuple[Any, ...]:  # raised in a trainer actor: Ray rebuilds it from both parts
        return type(self), (self.field, self.message)


class RunFailedError(RuntimeError):
    """A run stopped at run time for the reason its one-line message gives (``<field>: <what
    happened and the fix>``, e.g. too many failed rewards); not a bug, so no traceback, exit 1."""


class _Section(BaseModel):
    # strict: `true` is not a batch size, "yes" is not a boolean, 3.5 is not an int (an int is a float);
    # allow_inf_nan: no field of a config means anything at .inf or .nan
    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True, strict=True,
                              allow_inf_nan=False)


SettingsT = TypeVar("SettingsT", bound=BaseModel)


class _BackendSection(_Section):
    """A section that names a backend (``rollout.engine``, ``trainer.backend``, ``data.source``, ``eval.source``):
    it also holds backends' settings, each under its backend's name (``rollout.sglang``; config/backends.py)."""

    model_config = ConfigDict(extra="allow")  # backend sections only: the validator refuses any other key
    section_name: ClassVar[str]

    @model_validator(mode="after")
    def _backend_sections(self) -> _BackendSection:
        if extras := self.__pydantic_extra__:
            chosen = getattr(self, BACKEND_SECTIONS[self.section_name][0])
            extras.update(validate_sections(self.section_name, chosen, extras, list(type(self).model_fields)))
        return self

    @property
    def settings(self) -> BaseModel:
        """The chosen backend's settings: its section, or its model's defaults when the config gives none."""
        field, group = BACKEND_SECTIONS[self.section_name]
        chosen = getattr(self, field)
        given = (self.__pydantic_extra__ or {}).get(section_key(chosen))
        if given is not None:
            return given
        try:
            return settings_model(group, chosen)()
        except PluginError as err:
            raise ConfigError(f"{self.section_name}.{field}", str(err)) from None

    def settings_of(self, model: type[SettingsT], key: str) -> SettingsT:
        """A backend's own settings, typed: the chosen backend's when they are a ``model`` (named by name or by
        ``module:attr``), else the section ``key`` (an engine that wraps this one was chosen), else defaults."""
        try:
            chosen = self.settings
        except ConfigError:
            chosen = None
        if isinstance(chosen, model):
            return chosen
        given = (self.__pydantic_extra__ or {}).get(key)
        return given if isinstance(given, model) else model()


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
    critic_path: str | None = None  # PPO's critic: an HF folder to start it from; defaults to path (the policy)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: resolved once a run (config/dtype.py)


class DataConfig(_BackendSection):
    section_name = "data"
    source: str = "jsonl"  # data source plugin name or module:attr
    buffer: str = "default"  # sample buffer plugin name or module:attr
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
    # Vision-language prompts (docs/vlm.md): the column of a record's image(s); None: text-only data
    image_key: str | None = None
    max_image_pixels: int = Field(4096 * 4096, ge=1)  # a larger image is refused at file:line


class SandboxConfig(_Section):
    """rollout.sandbox: the limits of one sandboxed code call (core/sandbox, docs/sandbox.md)."""
    timeout_s: float = Field(10.0, gt=0)  # wall clock per call
    cpu_time_s: int = Field(10, ge=1)  # RLIMIT_CPU
    memory_mb: int = Field(1024, ge=64)  # RLIMIT_AS: the interpreter alone maps ~30 MB
    file_size_mb: int = Field(16, ge=1)  # RLIMIT_FSIZE
    scratch_mb: int = Field(64, ge=1)  # tmpfs scratch directory, the only writable place
    max_processes: int = Field(16, ge=1)  # RLIMIT_NPROC of the call's own uid
    max_open_files: int = Field(64, ge=16)  # RLIMIT_NOFILE
    max_output_bytes: int = Field(65536, ge=1)  # per stream; past it the call is killed, output truncated
    max_concurrency: int | None = Field(None, ge=1)  # calls at once per process; None: the cores, at most 32
    require_isolation: bool = False  # refuse to start where namespaces are unavailable
    python: str | None = None  # interpreter for the code; None: the base interpreter of this one
    readonly_paths: list[str] = Field(default_factory=list)  # extra host paths the code may read
    env: dict[str, str] = Field(default_factory=dict)  # the code's environment, besides PATH/HOME/LANG
    uid_base: int = Field(200_000, ge=1000, le=2**31 - 4096)  # calls run as uid_base, uid_base + 1, ...


class ElasticConfig(_Section):
    """rollout.elastic: rollout engines added and removed while a run goes (docs/elastic.md)."""
    enabled: bool = False  # the run takes `slime-cli engines add/remove` through its control endpoint
    grow_on_new_nodes: bool = False  # add an engine for each GPU node Ray reports after the start
    max_engines: int = Field(8, ge=1)  # adds beyond this are refused
    verify_weights: bool = False  # after each delta-mode sync, every engine's weights hashed against the trainer's


class GatewayConfig(_Section):
    """rollout.gateway: the agent gateway (core/gateway, docs/agents.md): the user's own agent, run per sample against an
    OpenAI-compatible server in front of the engines, with ``rollout.generate_fn: gateway``."""
    agent: str | None = None  # module:attr: async def run(base_url, api_key, sample) -> reward or final state
    command: list[str] = Field(default_factory=list)  # or a program per sample: OPENAI_BASE_URL/OPENAI_API_KEY in its env
    samples: Literal["trajectory", "per_call"] = "trajectory"  # one sample per episode (loss masks), or per model call
    agent_timeout: float = Field(600.0, gt=0)  # seconds per episode; then the sample fails
    model: str = "policy"  # the model name the gateway answers to (GET /v1/models lists it)
    tool_parser: Literal["hermes", "llama3"] = "hermes"  # the model family's tool-call format, into OpenAI tool_calls
    api_key: Secret | None = None  # the run's gateway key (each episode's key derives from it); unset: a fresh one
    gc_freeze: bool = True  # the rollout process's heap at the gateway's start is left out of the collector's scans
    gc_threshold: list[Annotated[int, Field(ge=1)]] | None = Field(  # gc.set_threshold there; null: Python's own
        default_factory=lambda: [20_000, 10, 10], min_length=1, max_length=3)


class RolloutConfig(_BackendSection):
    section_name = "rollout"
    engine: str = "hf"  # rollout engine plugin name or module:attr
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: Annotated[int, AfterValidator(_off_or_positive)] = -1  # -1: off
    max_prompt_len: int | None = Field(None, ge=1)  # longer prompts are refused by the data source
    max_response_len: int = Field(1024, ge=1)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    ignore_eos: bool = False  # responses run to max_response_len (long-context runs and benchmarks); eval keeps eos
    over_sampling_batch_size: int | None = Field(None, ge=1)  # prompts submitted per refill; >= rollout_batch_size
    dynamic_sampling_filter: str | None = None  # "nonzero_std" (DAPO) or module:attr
    partial_rollout: bool = False  # aborted groups go back to the buffer with their tokens
    generate_fn: str | None = None  # "multi_turn" (the built-in agent loop) or module:attr; unset: single turn
    max_turns: int = Field(4, ge=1)  # multi_turn: assistant turns per episode
    tools: list[str] = Field(default_factory=list)  # multi_turn: tools, each module:attr or the built-in "python"
    tool_timeout: float = Field(30.0, gt=0)  # multi_turn: seconds per tool call; then its error is the observation
    environment: str | None = None  # generate_fn environment: "tool_math", "guess_number" or module:attr (core/agent)
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)  # generate_fn gateway: the user's agent
    reward: str = "math"  # built-in reward name or module:attr
    group_reward: bool = False  # the reward takes a whole group
    reward_key: str | None = None  # for dict rewards
    # the `remote` reward POSTs each sample here (slime: --rm-url); saved and printed without credentials
    reward_url: Annotated[str | None, AfterValidator(remember_url), PlainSerializer(serialize_url)] = None
    reward_api_key: Secret | None = None  # the `remote` reward's key, sent as a bearer token; or env:NAME
    reward_timeout: float = Field(30.0, gt=0)  # seconds per reward call
    reward_concurrency: int = Field(64, ge=1)
    on_reward_failure: Literal["zero", "drop"] = "zero"
    reward_workers: int | None = Field(None, ge=0)  # processes running module:attr rewards/filters; 0: in process
    max_failed_fraction: float = Field(0.5, ge=0.0, le=1.0)  # a step fails when more of its samples failed
    max_failed_steps: int = Field(3, ge=1)  # this many failed steps in a row fail the run
    loop_block_warn_s: float = Field(10.0, gt=0)  # report when the rollout's event loop is blocked this long
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)  # the python tool's and code_tests' sandbox
    max_concurrency: int = Field(512, ge=1)  # in-flight generate requests
    update_weight_transport: Literal["auto", "tensor", "nccl", "disk"] = "auto"
    update_weight_buffer_mb: int = Field(2048, ge=1)  # bucket size; 512 MiB buckets made a 7B sync 3.4x slower
    # delta: send only the elements changed since the engines' version (core/weights/delta.py; docs/elastic.md)
    update_weight_mode: Literal["full", "delta"] = "full"
    elastic: ElasticConfig = Field(default_factory=ElasticConfig)  # engines joining and leaving a run
    lora_sync: Literal["adapter", "merged"] = "adapter"  # with trainer.lora: send the adapters, or merged weights
    # the weights the engines serve: the trainer's dtype, or FP8 quantised at every sync (docs/fp8.md)
    precision: Literal["model", "fp8"] = "model"
    kv_cache_dtype: Literal["auto", "fp8_e4m3"] = "auto"  # the engines' KV cache (docs/fp8.md); separate from precision
    max_staleness: int | None = Field(None, ge=0)  # eta: tokens more than this many versions behind are stale
    staleness_policy: Literal["drop", "mask", "downweight"] = "drop"  # what happens to stale tokens (core/staleness.py)
    buffer_filter: str | None = None  # which buffered groups to hand out: "oldest_first", "freshest_first", module:attr


def _registered(registry: Any) -> Any:
    """An optional registry name: None, or what ``registry.check_name`` accepts."""
    def check(spec: str | None) -> str | None:
        return None if spec is None else registry.check_name(spec)

    return check


class AlgorithmConfig(_Section):
    # The names are core/algorithms/registry.py's; a `module:attr` is the user's, loaded by check_config.
    advantage_estimator: Annotated[str, AfterValidator(ADVANTAGE_ESTIMATORS.check_name)] = "grpo"
    loss_type: Literal["policy", "sft"] = "policy"
    policy_loss: Annotated[str, AfterValidator(POLICY_LOSSES.check_name)] = "ppo"
    grpo_std_normalization: bool = True  # off automatically when n_samples_per_prompt == 1
    normalize_advantages: bool = False  # batch whitening
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    lambd: float = Field(1.0, ge=0.0, le=1.0)
    eps_clip: float = Field(0.2, gt=0)
    eps_clip_high: float | None = Field(None, gt=0)  # defaults to eps_clip
    eps_clip_c: float | None = None  # dual-clip, > 1
    use_tis: bool = False  # token-level TIS: the same as rollout_correction: tis with rollout_correction_high: tis_clip
    tis_clip: float = Field(2.0, gt=0)
    # the trainer/engine mismatch (docs/algorithms.md): tis, icepop, seq-tis, seq-mask-tis or module:attr; null: none
    rollout_correction: Annotated[str | None, AfterValidator(_registered(ROLLOUT_CORRECTIONS))] = None
    rollout_correction_low: float | None = Field(None, gt=0)  # a masking one's band [low, high]; null: 1 / high
    rollout_correction_high: float = Field(2.0, gt=0)  # a truncating one's cap; a masking one's top of the band
    kl_coef: float = Field(0.0, ge=0.0)  # KL as a reward penalty
    use_kl_loss: bool = False
    kl_loss_coef: float = Field(0.0, ge=0.0)
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = "low_var_kl"
    entropy_coef: float = Field(0.0, ge=0.0)
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    value_clip: float = Field(0.2, gt=0.0)
    use_rollout_logprobs: bool = False  # use the engine's log-probs as the old policy
    routing_replay: Literal["off", "rollout"] = "off"  # MoE: the trainer replays the engine's expert choices
    # advantage_estimator=opd (docs/distillation.md): A_t = opd_kl_coef * (log pi_teacher - log pi_student)
    # + opd_reward_coef * (the task reward's GRPO advantage)
    opd_kl_coef: float = Field(1.0, ge=0.0)
    opd_reward_coef: float = Field(0.0, ge=0.0)
    # DAPO's overlong handling (core/algorithms/overlong.py): samples truncated at the length limit dropped from
    # the loss (counted), and a reward penalty falling linearly to -overlong_penalty_factor over the last
    # overlong_buffer_len tokens before rollout.max_response_len (null: off)
    overlong_filter: bool = False
    overlong_buffer_len: int | None = Field(None, ge=1)
    overlong_penalty_factor: float = Field(1.0, ge=0.0)


# Micro-batches packed up to this many tokens unless the user asks for micro-batches by count: one
# sample per micro-batch (the old default) kept a 3B model's train phase at ~1% MFU (issue 16).
DEFAULT_MAX_TOKENS_PER_GPU = 8192
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # HF names


class LoraConfig(_Section):
    """trainer.lora: low-rank adapters on the attention and MLP projections (core/lora.py); rank 0: off."""
    rank: int = Field(0, ge=0)
    alpha: float = Field(32.0, gt=0)  # the adapter's output is scaled by alpha / rank (PEFT's lora_alpha)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = Field(default_factory=lambda: list(LORA_TARGET_MODULES))  # HF projection names

    @field_validator("target_modules")
    @classmethod
    def _known_modules(cls, value: list[str]) -> list[str]:
        unknown = [m for m in value if m not in LORA_TARGET_MODULES]
        if unknown or not value:
            raise ValueError(f"{unknown or value!r}: give a non-empty list of {', '.join(LORA_TARGET_MODULES)}")
        return value


class TrainerConfig(_BackendSection):
    section_name = "trainer"
    backend: str = "megatron"  # trainer plugin name or module:attr
    global_batch_size: int | None = Field(None, ge=1)  # samples per optimizer step; derived when unset
    num_steps_per_rollout: int = Field(1, ge=1)
    micro_batch_size: int = Field(1, ge=1)  # by count: used when max_tokens_per_gpu is null
    max_tokens_per_gpu: int | None = Field(DEFAULT_MAX_TOKENS_PER_GPU, ge=1)  # micro-batching by a token budget

    @model_validator(mode="before")
    @classmethod
    def _count_when_only_micro_batch_size_is_set(cls, data: Any) -> Any:
        """A user who sets ``micro_batch_size`` and not ``max_tokens_per_gpu`` asked for micro-batches by count."""
        if isinstance(data, dict) and "micro_batch_size" in data and "max_tokens_per_gpu" not in data:
            return {**data, "max_tokens_per_gpu": None}
        return data
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
    critic_lr: float | None = Field(None, gt=0)  # PPO critic; defaults to lr
    on_nonfinite: Literal["skip", "stop"] = "skip"  # a step whose loss or gradient is nan/inf: skip it, or fail
    lora: LoraConfig = Field(default_factory=LoraConfig)  # rank > 0: train adapters only, the base frozen
    # a vision-language model: keep the vision tower and its merger as loaded (slime's default trains them: its
    # freezing is opt-in, --freeze-params-name-list)
    freeze_vision_tower: bool = False


class ParallelConfig(_Section):
    tensor_model_parallel_size: int = Field(1, ge=1)
    pipeline_model_parallel_size: int = Field(1, ge=1)
    # Megatron trainer: each packed sequence split over this many ranks (2 * CP chunks, causal load balance;
    # trainer_megatron/context_parallel.py, docs/long-context.md); needs trainer.max_tokens_per_gpu
    context_parallel_size: int = Field(1, ge=1)
    sequence_parallel: bool = False
    expert_model_parallel_size: int = Field(1, ge=1)  # MoE: experts spread over this many ranks
    expert_tensor_parallel_size: int = Field(1, ge=1)  # MoE: each expert split over this many ranks


AsyncMode = Literal["off", "one_step", "fully"]


class ClusterConfig(_Section):
    device: Literal["auto", "cpu", "cuda"] = "auto"
    actor_num_nodes: int = Field(1, ge=1)
    actor_num_gpus_per_node: int = Field(1, ge=1)  # trainer ranks per node (processes on CPU)
    rollout_num_gpus: int | None = Field(None, ge=1)  # defaults: the actor's GPUs when colocated
    rollout_num_gpus_per_engine: int = Field(1, ge=1)  # the engine's tensor-parallel size
    num_gpus_per_node: int | None = Field(None, ge=1)  # node size, for placement; default max(8, actor's per node)
    colocate: bool = True
    async_mode: AsyncMode = "off"  # off | one_step (generate k+1 while training k) | fully (core/fully_async.py)
    offload: bool | None = None  # colocated: hand the GPUs back and forth between phases; unset: on when colocated
    num_cpus: int | None = Field(None, ge=1)  # for the local Ray instance
    # Every wait of the driver (infra/stall.py): a warning past warn_factor x the phase's median, failure past
    # fail_factor x the median and fail_floor_s (a phase's first wait: past 3 x fail_floor_s)
    stall_warn_factor: float = Field(3.0, gt=0)
    stall_fail_factor: float = Field(20.0, gt=0)
    stall_fail_floor_s: float = Field(600.0, gt=0)

    @field_validator("async_mode", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare `off` as false: that is the mode off, not a boolean.
        if value is False:
            return "off"
        if value is True:
            raise ValueError("cluster.async_mode: true is not a mode; give off, one_step or fully")
        return value


class EvalConfig(_BackendSection):
    section_name = "eval"
    source: str = "jsonl"  # data source plugin (its for_eval) reading each eval set: name or module:attr
    interval: int | None = Field(None, ge=1)  # rollout steps between evals; None: only before and after
    prompt_data: dict[str, str] = Field(default_factory=dict)  # eval set name -> file
    n_samples_per_prompt: int = Field(1, ge=1)
    temperature: float = Field(0.0, ge=0.0)  # 0: greedy
    max_response_len: int | None = Field(None, ge=1)  # defaults to rollout.max_response_len


class CheckpointConfig(_Section):
    save_dir: str | None = None  # default: <logging.dir>/checkpoints
    save_interval: int | None = Field(None, ge=1)
    resume: bool = False  # continue from the newest checkpoint in save_dir
    save_hf: bool = False  # also write an HF folder with every checkpoint (with trainer.lora: a PEFT adapter folder)
    save_hf_merged: bool = False  # with trainer.lora and save_hf: also the merged model, in <hf folder>/merged
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
    roles: dict[str, RoleConfig] = Field(default_factory=dict)  # served models beside the policy (config/roles.py)

    @model_validator(mode="before")
    @classmethod
    def _old_key_names(cls, data: Any) -> Any:
        """Keys that moved (config/renamed.py) load for a release from Python too, each with its notice."""
        return move_renamed_keys(copy.deepcopy(data)) if isinstance(data, dict) else data

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
        return self.actor_num_gpus // (p.tensor_model_parallel_size * p.context_parallel_size
                                       * p.pipeline_model_parallel_size)

    def to_dict(self, *, reveal_secrets: bool = False) -> dict[str, Any]:
        """The config as plain data, keys redacted (config/secrets.py); ``reveal_secrets`` only for
        the run's own actors, which send them."""
        return self.model_dump(mode="json", by_alias=True, context={"reveal_secrets": reveal_secrets})

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

