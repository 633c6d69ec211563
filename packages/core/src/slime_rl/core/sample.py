"""`Sample`: the one currency between data source, rollout, buffer and trainer."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class SampleStatus(StrEnum):
    PENDING = "pending"  # not generated yet (or waiting to be resumed, see partial rollout)
    COMPLETED = "completed"  # the engine stopped on a stop token or string
    TRUNCATED = "truncated"  # the engine hit max_new_tokens / the context limit
    ABORTED = "aborted"  # generation was cut short by abort; may hold partial response tokens
    FAILED = "failed"  # generation or reward failed; metadata["error"] says why


Reward = float | dict[str, float]


@dataclass
class Sample:
    """One prompt and (after rollout) one sampled response.

    Token layout: ``tokens`` is prompt ids followed by response ids, and
    ``response_length`` counts the response part, so ``tokens[-response_length:]``
    are the response ids. Every per-token list below (``loss_mask``,
    ``rollout_log_probs``, ``old_log_probs``, ``ref_log_probs``, ``advantages``,
    ``returns``, ``values``) has exactly ``response_length`` entries, one per
    response token. Log-probs are natural-log probabilities of the sampled token
    under the temperature-scaled distribution the engine sampled from.
    """

    index: int = 0  # global sample index (unique within a run)
    group_index: int = 0  # samples of the same prompt share it
    prompt: str | list[dict[str, Any]] = ""  # text, or chat messages
    label: Any = None
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    loss_mask: list[int] = field(default_factory=list)  # 1 = trained on; 0 = tool/observation output
    rollout_log_probs: list[float] = field(default_factory=list)  # from the engine
    reward: Reward | None = None
    status: SampleStatus = SampleStatus.PENDING
    weight_version: int = 0  # the policy version that produced the (oldest part of the) response
    metadata: dict[str, Any] = field(default_factory=dict)
    # Filled on the training side.
    old_log_probs: list[float] = field(default_factory=list)  # trainer's, before the update
    ref_log_probs: list[float] = field(default_factory=list)  # the reference model's
    advantages: list[float] = field(default_factory=list)
    returns: list[float] = field(default_factory=list)  # PPO value targets
    values: list[float] = field(default_factory=list)  # PPO critic values
    # MoE routing replay: the experts the engine routed each token to, [len(tokens) (or one fewer:
    # the last token is never fed)][layers][top-k]; empty unless algorithm.routing_replay is on.
    rollout_routed_experts: list[list[list[int]]] = field(default_factory=list)
    # The policy version that produced each response token (tool tokens: the one before them); a
    # response generated across in-flight weight updates holds several. Empty before generation.
    token_versions: list[int] = field(default_factory=list)
    # Vision-language samples (docs/vlm.md): {"images": [a file path or a data: URI, ...]}, the images in the
    # order their placeholder runs appear in ``tokens``, and once observations brought more, "prompt_images":
    # how many are the prompt's. JSON-safe: what a saved or resumed sample keeps. None: a text-only sample.
    multimodal_inputs: dict[str, Any] | None = None
    # What the trainer's vision tower takes, made by the model's processor from ``multimodal_inputs``:
    # {"pixel_values": [patches, C*T*P*P] float32 tensor, "image_grid_thw": [images, 3] int64 tensor}.
    # Derived, so never saved (to_dict and the buffer's store leave it out); slime_rl.core.vision.train_inputs
    # rebuilds it where it is missing.
    multimodal_train_inputs: dict[str, Any] | None = None

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[len(self.tokens) - self.response_length :]

    def reward_value(self, key: str | None = None) -> float:
        """The scalar reward: the float itself, or ``reward[key]`` for dict rewards."""
        if self.reward is None:
            raise ValueError(f"sample {self.index} has no reward yet")
        if isinstance(self.reward, dict):
            if key is None:
                raise ValueError(f"sample {self.index} has a dict reward {sorted(self.reward)}; set reward_key")
            return float(self.reward[key])
        return float(self.reward)

    def append_response(self, token_ids: list[int], log_probs: list[float] | None, *, trained: bool,
                        versions: list[int] | None = None) -> None:
        """Append tokens to the response: sampled tokens (``trained=True``, with log-probs)
        or observation/tool tokens (``trained=False``, loss_mask 0, log-prob 0). ``versions``: the
        policy version of each token (`GenerateOutput.token_versions`); None: the latest one known."""
        if log_probs is not None and len(log_probs) != len(token_ids):
            raise ValueError(f"{len(token_ids)} tokens but {len(log_probs)} log-probs")
        if versions is not None and len(versions) != len(token_ids):
            raise ValueError(f"{len(token_ids)} tokens but {len(versions)} token versions")
        self.token_versions = self.versions_per_token()  # a sample from before token versions: fill it in
        latest = self.token_versions[-1] if self.token_versions else self.weight_version
        self.token_versions.extend(versions if versions is not None else [latest] * len(token_ids))
        self.tokens.extend(token_ids)
        self.response_length += len(token_ids)
        self.loss_mask.extend([1 if trained else 0] * len(token_ids))
        self.rollout_log_probs.extend(log_probs if log_probs is not None else [0.0] * len(token_ids))

    def reset_to_prompt(self, version: int | None = None) -> Sample:
        """Drop the response, in place: a PENDING prompt again that generates from scratch."""
        self.tokens = self.tokens[: self.prompt_length]
        self.response, self.response_length = "", 0
        self.loss_mask, self.rollout_log_probs = [], []
        self.reward, self.status = None, SampleStatus.PENDING
        self.old_log_probs, self.ref_log_probs, self.advantages, self.returns, self.values = [], [], [], [], []
        self.rollout_routed_experts = []
        self.token_versions = []
        if self.multimodal_inputs and "prompt_images" in self.multimodal_inputs:  # observations' pictures go too
            inputs = dict(self.multimodal_inputs)
            inputs["images"] = inputs["images"][:inputs.pop("prompt_images")]
            self.multimodal_inputs, self.multimodal_train_inputs = inputs, None
        self.metadata.pop("error", None)
        if version is not None:
            self.weight_version = version
        return self

    def versions_per_token(self) -> list[int]:
        """``token_versions``, or ``weight_version`` for every response token when the engine gave none."""
        if len(self.token_versions) == self.response_length:
            return list(self.token_versions)
        return [self.weight_version] * self.response_length

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (status as its string value; no ``multimodal_train_inputs``, which are derived)."""
        out = dataclasses.asdict(dataclasses.replace(self, multimodal_train_inputs=None))
        out["status"] = self.status.value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sample:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown Sample fields {sorted(unknown)}")
        kwargs = dict(data)
        if "status" in kwargs:
            kwargs["status"] = SampleStatus(kwargs["status"])
        return cls(**kwargs)
