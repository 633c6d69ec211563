"""The contracts between slime-rl's parts. Backends implement these; core never imports a backend.

Units used throughout:
- token ids are ``int`` vocabulary indices; a response is the ids an engine sampled,
  never re-tokenised text;
- log-probs are natural logs of the sampled token's probability under the
  temperature-scaled distribution (logits / temperature, then top-p/top-k do not
  renormalise the reported value), one per generated token;
- a weight version is an ``int`` that starts at 0 (the initial weights) and grows
  by one with every sync from the trainer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

import torch
from pydantic import BaseModel

from slime_rl.core.config.backends import NoSettings
from slime_rl.core.sample import Reward, Sample

if TYPE_CHECKING:
    from slime_rl.core.batch import RolloutBatch
    from slime_rl.core.config import Config

FinishReason = Literal["stop", "length", "abort"]
NamedTensors = list[tuple[str, torch.Tensor]]  # Hugging Face parameter names, full (unsharded) tensors


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    max_new_tokens: int = 1024
    stop: list[str] = field(default_factory=list)  # stop strings (the tokens that complete one stay in the response)
    stop_token_ids: list[int] = field(default_factory=list)  # besides the model's eos
    ignore_eos: bool = False
    seed: int | None = None
    return_routed_experts: bool = False  # MoE routing replay: report the experts each token went to


@dataclass
class GenerateOutput:
    token_ids: list[int]  # the new tokens only
    log_probs: list[float]  # one per new token
    finish_reason: FinishReason
    weight_version: int  # the engine's weight version when the request finished
    # with return_routed_experts: [input + new tokens - 1][layers][top-k], the experts of every token fed
    routed_experts: list[list[list[int]]] | None = None
    # The policy version that produced each new token (several when weights changed mid-request);
    # None: the engine does not say, and every token counts as ``weight_version``.
    token_versions: list[int] | None = None
    cached_tokens: int | None = None  # input tokens served from the prefix cache; None: not reported


class RolloutEngine(ABC):
    """Token-in, token-out generation. All methods are coroutines; an engine may
    serve many concurrent ``generate`` calls. One object fronts all of a run's
    rollout servers (the SGLang engine holds N servers behind a router)."""

    #: ``module:attr`` of a `WeightSender` the trainer ranks run to push weights straight to this
    #: engine's servers (CUDA IPC, NCCL). None: buckets reach `update_weights` through Ray.
    weight_sender: ClassVar[str | None] = None

    #: The optional guarantees this engine claims (`slime_rl.core.testing.conformance.CAPABILITIES`):
    #: ``"pause"`` (`pause_generation` holds requests in place), ``"release_memory"`` (`release_memory` /
    #: `resume_memory` keep the engine correct), ``"routed_experts"`` (MoE models: ``return_routed_experts``).
    #: The conformance suite checks exactly these; ``slime-cli doctor`` lists the class's. An engine whose
    #: capabilities depend on what it serves (routed experts only for a MoE model) sets its own in ``__init__``.
    capabilities: ClassVar[frozenset[str]] = frozenset()

    #: Vision-language models (docs/vlm.md): True when ``generate`` also takes ``images=`` (a sample's
    #: ``multimodal_inputs["images"]``: paths or data URIs, one per run of image pad tokens in ``input_ids``,
    #: in order). ``input_ids`` are then the processor's, pads expanded; what the engine sends its servers is
    #: its own affair (slime_rl.core.vision.contract: SGLang gets one pad per image). The rollout calls
    #: ``generate`` with ``images=`` only for samples that have images, and refuses image data up front for
    #: an engine without it.
    accepts_images: ClassVar[bool] = False

    #: This backend's typed config keys: a pydantic model (`slime_rl.core.config.BackendSettings` is a strict
    #: base), read from the config section named after the backend (``rollout.sglang``) and checked at load time
    #: like core's keys; `from_config` reads it as ``cfg.rollout.settings``. Register the same model under the entry-point
    #: group ``slime_rl.rollout_engines.settings`` too, in a module that imports no torch: then the config is checked without
    #: importing the backend (config/backends.py).
    settings: ClassVar[type[BaseModel]] = NoSettings

    @classmethod
    def from_config(cls, cfg: Config) -> RolloutEngine:
        """Build (launch or attach) the engine a config describes. Called once, in the rollout process."""
        raise NotImplementedError(f"{cls.__name__} does not implement from_config")

    async def begin_weight_sync(self, version: int, *, transport: str) -> Any:
        """For engines with a `weight_sender`: hold generation and return the (picklable) handle
        the trainer's sender pushes to."""
        raise NotImplementedError(f"{type(self).__name__} has no trainer-side weight sync")

    async def end_weight_sync(self, version: int) -> None:
        """For engines with a `weight_sender`: the push is complete; serve ``version``."""
        raise NotImplementedError(f"{type(self).__name__} has no trainer-side weight sync")

    @abstractmethod
    async def generate(
        self, input_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> GenerateOutput:
        """Sample a continuation of ``input_ids``. An aborted request returns the
        tokens made so far with ``finish_reason="abort"``. A ``request_id`` of the form
        ``<session>/<turn>`` marks the turns of one multi-turn episode: an engine with several
        servers sends all of a session's requests to the same one (its prefix cache holds them)."""

    @abstractmethod
    async def abort(self, request_id: str | None = None) -> None:
        """Abort one request, or every in-flight request when ``request_id`` is None."""

    @abstractmethod
    async def update_weights(self, named_tensors: NamedTensors, *, version: int, last: bool) -> None:
        """Load one bucket of HF-named full tensors. Buckets of one sync share
        ``version``; ``last=True`` marks the final bucket, after which the engine
        serves the new weights and reports ``version``."""

    @property
    @abstractmethod
    def weight_version(self) -> int: ...

    #: Whether `update_weights` takes delta buckets (core/weights/delta.py) itself. Otherwise the rollout
    #: worker rebuilds full tensors from `current_weight` first; an engine with neither gets full syncs only.
    loads_delta_buckets: ClassVar[bool] = False

    def current_weight(self, name: str) -> torch.Tensor:
        """The tensor this engine serves under HF name ``name`` (read-only), for a delta sync. Optional."""
        raise NotImplementedError(f"{type(self).__name__} does not expose its weights; syncs are full")

    async def pause_generation(self) -> bool:
        """Hold every running request where it is (no abort, no re-prefill) until
        `continue_generation`, so a weight update can land mid-request. Returns False when this
        engine cannot pause: the caller then aborts and resumes the requests as partial rollouts."""
        return False

    async def continue_generation(self) -> None:
        """Resume what `pause_generation` held."""

    async def release_memory(self) -> None:
        """Free accelerator memory (weights, KV cache) for a colocated trainer. Optional."""

    async def resume_memory(self, tags: list[str] | None = None) -> None:
        """Take back what ``release_memory`` freed: all of it (``tags`` None), or only the kinds named
        (``["weights"]``). The colocated loop takes the weights back before a weight sync, while the
        trainer still holds its own memory, and the rest (KV cache, CUDA graphs) once the trainer
        has offloaded. Optional."""

    async def health(self) -> bool:
        return True

    def stats(self) -> dict[str, float]:
        """Counters for the step metrics (``engine/restarts``, ``engine/request_retries``). Optional."""
        return {}

    async def shutdown(self) -> None:
        """Stop servers and free resources. Safe to call twice."""


class WeightSender(ABC):
    """Runs in every trainer rank and pushes the weights to an engine's servers directly."""

    def __init__(self, cfg: Config, *, rank: int):
        self.cfg, self.rank = cfg, rank

    @abstractmethod
    def send(self, buckets: Iterator[NamedTensors], handle: Any, *, version: int, transport: str) -> None:
        """Consume ``buckets`` (the trainer's `named_weights`, a collective every rank must run to
        the end) and push them to the servers ``handle`` names (from `begin_weight_sync`)."""


class PolicyTrainer(ABC):
    """One rank of a (possibly TP x PP x DP) trainer.

    Each rank receives its data-parallel rank's shard of the step (`RolloutBatch`, batch.py): the
    tensor- and pipeline-parallel peers of one DP rank get the same shard. Per-token results come
    back as float32 tensors over the shard's response tokens (``[batch.num_response_tokens]``),
    identical on every rank of the shard."""

    #: This backend's typed config keys: a pydantic model (`slime_rl.core.config.BackendSettings` is a strict
    #: base), read from the config section named after the backend (``trainer.megatron``) and checked at load time
    #: like core's keys; `from_config` reads it as ``cfg.trainer.settings``. Register the same model under the entry-point
    #: group ``slime_rl.trainers.settings`` too, in a module that imports no torch: then the config is checked without
    #: importing the backend (config/backends.py).
    settings: ClassVar[type[BaseModel]] = NoSettings

    @classmethod
    def from_config(cls, cfg: Config, *, role: Literal["actor", "critic"] = "actor") -> PolicyTrainer:
        """Build this rank's trainer. Called in each rank's process with the torch.distributed
        environment set (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK); the trainer
        initialises the process group (gloo on CPU, nccl on CUDA) and its model-parallel groups."""
        raise NotImplementedError(f"{cls.__name__} does not implement from_config")

    @property
    def data_parallel_rank(self) -> int:
        """This rank's data-parallel index: which shard it trains on."""
        return 0

    def sum_over_dp(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the data-parallel ranks (every rank gets the sum): group statistics
        and batch whitening span the whole step. One DP rank: ``tensor`` itself."""
        return tensor

    @abstractmethod
    def compute_log_probs(self, batch: RolloutBatch, *, model: Literal["actor", "ref"] = "actor") -> torch.Tensor:
        """One log-prob per response token of the shard (at the rollout temperature)."""

    @abstractmethod
    def train_step(self, batch: RolloutBatch) -> dict[str, float]:
        """Train on the shard: one optimizer step per `RolloutBatch.optimizer_steps` entry (the loss of
        each divides by that step's token and sample counts over all shards), using ``advantages``,
        ``old_log_probs`` (absent: the ratio is 1 at the current weights) and, with a KL loss,
        ``ref_log_probs``; a critic uses ``values`` and ``returns``. Returns metrics reduced over
        the data-parallel ranks (loss, grad_norm, clip_frac, kl, entropy, lr, ...)."""

    @abstractmethod
    def named_weights(self, bucket_bytes: int) -> Iterator[NamedTensors]:
        """The policy's weights for a sync, in buckets of about ``bucket_bytes`` (a tensor never
        splits). Collective: every rank must iterate it to the end.

        Without LoRA, or with ``rollout.lora_sync: merged``: the full weights under HF names, the
        adapters merged in (`slime_rl.core.algorithms.lora.merged`). When `syncs_adapters(cfg)`: ONLY the
        adapters, each ``peft_name(hf_name, "A"|"B")``, whole (gathered over TP), in the trainer's
        dtype; a fused trainer layer (Megatron's q/k/v or gate/up) exports exact per-HF-module
        adapters (one shared A, B split by rows), and A and B of one module may fall in two buckets."""

    @abstractmethod
    def save(self, path: str) -> None: ...

    def save_hf(self, folder: str) -> None:
        """Write the policy as a Hugging Face folder (``checkpoint.save_hf``; with LoRA a PEFT adapter
        folder). Collective. Optional."""
        raise NotImplementedError(f"{type(self).__name__} cannot write HF folders; set checkpoint.save_hf=false")

    @abstractmethod
    def load(self, path: str) -> None: ...

    def offload(self) -> None:
        """Move weights and optimizer state to host memory (colocation). Optional."""

    def onload(self) -> None:
        """Bring back what ``offload`` moved. Optional."""

    def compute_values(self, batch: RolloutBatch) -> torch.Tensor:
        """Critic values, one per response token of the shard (PPO). Only trainers with a value head."""
        raise NotImplementedError(f"{type(self).__name__} has no value head")


class DataSource(ABC):
    """Prompts in, groups of PENDING samples out (``n_samples_per_prompt`` per group).

    Bad data is a `slime_rl.core.run.data.DataError` naming ``file:line`` (or the field) and the fix,
    whenever it is found: it reaches the user's terminal as one line, exit 2, from a Ray actor too."""

    #: This backend's typed config keys: a pydantic model (`slime_rl.core.config.BackendSettings` is a strict
    #: base), read from the config section named after the backend (``data.jsonl``) and checked at load time
    #: like core's keys; `from_config` reads it as ``cfg.data.settings``. Register the same model under the entry-point
    #: group ``slime_rl.data_sources.settings`` too, in a module that imports no torch: then the config is checked without
    #: importing the backend (config/backends.py).
    settings: ClassVar[type[BaseModel]] = NoSettings

    @classmethod
    def check(cls, cfg: Config) -> None:
        """Optional: read through the data a run of ``cfg`` will take from this source and raise
        DataError for the first bad record (with ``data.skip_bad_lines``, only when none is usable).
        slime-cli calls it in the driver before Ray starts (``train`` and ``plan``), so keep it
        streaming and cheap. The default checks nothing: errors then surface as the run reads."""

    @classmethod
    def for_eval(cls, cfg: Config, name: str, tokenizer: Any = None) -> DataSource:
        """For a source named by ``eval.source``: eval set ``name`` (a key of ``eval.prompt_data``), every
        prompt once and in order, ``eval.n_samples_per_prompt`` samples a group. Built in the rollout process."""
        raise NotImplementedError(f"{cls.__name__} does not read eval sets; set eval.source to a source that does")

    @classmethod
    def check_eval(cls, cfg: Config) -> None:
        """Optional: `check` for every eval set `for_eval` will read (``eval.source``'s; the same rules)."""

    @abstractmethod
    def get_groups(self, num_groups: int) -> list[list[Sample]]:
        """The next ``num_groups`` prompt groups; fewer (possibly none) at the end of the data."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]: ...

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Buffer(ABC):
    """Holds groups of samples between rollout and training (and aborted partial
    groups until they are resumed). Implementations persist what ``add`` accepted."""

    @abstractmethod
    def add(self, groups: list[list[Sample]]) -> None:
        """Store groups durably; when it returns, they survive a crash."""

    @abstractmethod
    def take(self, num_groups: int, *, current_version: int | None = None,
             partial: bool = False) -> list[list[Sample]]:
        """Remove and return up to ``num_groups`` groups (fewer when it holds fewer): finished
        groups to train on, or with ``partial=True`` groups that still need generation (reset
        prompts and aborted partial rollouts). ``current_version`` lets it apply a staleness bound."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of groups held."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]: ...

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# ---------------------------------------------------------------- user functions
# Plain functions (or callables), named in the config by a built-in name or ``module:attr`` and loaded
# with `slime_rl.core.infra.plugins.load_function`; slime-cli loads each before the run starts. A user's
# reward or filter runs in a worker process (core/workers.py): what counts is what it returns.


class RewardFunction(Protocol):
    """``rollout.reward``: one sample's reward. ``async def`` or plain ``def`` (run in a thread).

    Reads ``sample.response`` (the decoded text), ``sample.label`` and ``sample.metadata``; returns a
    float, or a dict of floats (``rollout.reward_key`` names the one advantages use). A call that
    raises, times out (``rollout.reward_timeout``) or returns anything else fails its sample
    (``rollout.on_reward_failure``). Built in: core/rewards (``math``, ``dapo``, ``f1``, ...)."""

    def __call__(self, sample: Sample, /) -> Reward | Awaitable[Reward]: ...


class GroupRewardFunction(Protocol):
    """``rollout.reward`` with ``rollout.group_reward: true``: the rewards of one prompt's samples,
    scored together (pairwise preference, a judge over the group), one per sample, in order."""

    def __call__(self, samples: list[Sample], /) -> list[Reward] | Awaitable[list[Reward]]: ...


class DynamicSamplingFilter(Protocol):
    """``rollout.dynamic_sampling_filter``: keep a scored group (True) or drop it (False), as slime's
    ``--dynamic-sampling-filter-path``; the rollout over-samples until ``rollout_batch_size`` groups
    pass. Built in: ``nonzero_std`` (DAPO: drop groups whose rewards are all equal; core/filters.py)."""

    def __call__(self, group: list[Sample], /) -> bool: ...


class BufferFilter(Protocol):
    """``rollout.buffer_filter``: which buffered groups go out next. Gets the groups the buffer holds of
    the kind being taken (finished ones for training, or partial ones to resume generating), oldest
    first, and how many are wanted; returns at most that many distinct positions into ``groups``, in
    the order they go out. Built in: ``oldest_first`` (the default), ``freshest_first`` (core/filters.py)."""

    def __call__(self, groups: list[list[Sample]], num_groups: int, /) -> list[int]: ...


class GenerateFunction(Protocol):
    """``rollout.generate_fn``: replaces single-turn generation (multi-turn, tool calls).

    Generates ``sample``'s response through ``engine`` (token-in, token-out), appending sampled tokens
    with ``Sample.append_response(ids, log_probs, trained=True)`` and observation tokens (tool output)
    with ``trained=False`` (loss_mask 0); returns the sample, or several samples for one prompt. Must
    be ``async def``; an exception fails only its sample."""

    async def __call__(self, sample: Sample, params: SamplingParams, engine: RolloutEngine, /
                       ) -> Sample | list[Sample]: ...


GenerateFn = GenerateFunction  # the name rollout.py annotates with
