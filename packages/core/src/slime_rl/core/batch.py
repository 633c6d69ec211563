"""`RolloutBatch`: a scored rollout step as columns of tensors, the trainer ranks' input.

The rollout process turns the step's kept samples into one `RolloutBatch` and splits it
into one shard per data-parallel rank (`shard`): each optimizer step's samples are dealt
to the ranks longest first, each to the rank with the fewest tokens so far. The shards go
into Ray's object store; the driver passes their references on and never holds a token.
Each trainer rank fetches only its own shard, adds its per-token results (old and
reference log-probs, values, advantages, returns) as tensors, and trains on it.

Layout: ``tokens`` is every sample's prompt and response ids, concatenated; the per-token
columns (``loss_mask``, ``rollout_log_probs``, ...) hold the response tokens only, in the
same sample order. ``positions`` say where each sample sits in the whole step (all shards):
a reduction over data-parallel ranks (group statistics, whitening) scatters into a
``[step_size]`` vector at these positions and sums it over the ranks.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from slime_rl.core.sample import Sample

#: Per-response-token columns the trainer side fills in (float32, ``[num_response_tokens]``).
TRAINER_COLUMNS = ("old_log_probs", "ref_log_probs", "values", "advantages", "returns")
#: Optional per-response-token columns the rollout side fills in (None when unused).
ROLLOUT_OPTIONAL_COLUMNS = ("token_versions", "token_weights", "teacher_log_probs")


@dataclass
class RolloutBatch:
    tokens: Tensor  # [T] int32: prompt + response ids of every sample, concatenated
    lengths: Tensor  # [B] int64: tokens per sample (prompt + response)
    response_lengths: Tensor  # [B] int64
    loss_mask: Tensor  # [R] uint8: 1 on tokens trained on, 0 on tool/observation output
    rollout_log_probs: Tensor  # [R] float32: the engine's log-probs of the sampled tokens
    rewards: Tensor  # [B] float64: the scalar reward (rollout.reward_key applied)
    group_ids: Tensor  # [B] int64: Sample.group_index
    sample_ids: Tensor  # [B] int64: Sample.index
    weight_versions: Tensor  # [B] int64: the policy version that generated each sample
    positions: Tensor  # [B] int64: each sample's place in the whole step (all shards)
    step_size: int  # samples in the whole step, all shards together
    # Optimizer steps: how many of this shard's samples (in order) each step trains on, and
    # each step's loss-token and sample counts over all shards (the losses divide by those).
    step_samples: list[int] = field(default_factory=list)
    step_tokens: list[float] = field(default_factory=list)
    step_seqs: list[int] = field(default_factory=list)
    dp_rank: int = 0
    # Filled on the trainer ranks (TRAINER_COLUMNS).
    old_log_probs: Tensor | None = None
    ref_log_probs: Tensor | None = None
    values: Tensor | None = None
    advantages: Tensor | None = None
    returns: Tensor | None = None
    # MoE routing replay: [T, layers, top-k] int16, the engine's experts for each of ``tokens``
    routed_experts: Tensor | None = None
    # [R] int64: the policy version that produced each response token (core/staleness.py reads it).
    token_versions: Tensor | None = None
    # [R] float32: each token's loss weight under rollout.staleness_policy=downweight; None: all 1.
    token_weights: Tensor | None = None
    # [R] float32: on-policy distillation, the teacher's log-probs of the sampled tokens (core/roles/teacher.py)
    teacher_log_probs: Tensor | None = None
    # [B] a vision-language model's inputs per sample: the processor's {"pixel_values", "image_grid_thw"} tensors
    # of its images (Sample.multimodal_train_inputs), None for a sample without images; None: no sample has any
    images: list[dict[str, Tensor] | None] | None = None

    # ---------------------------------------------------------------- building

    @classmethod
    def from_samples(cls, samples: Sequence[Sample], *, reward_key: str | None = None) -> RolloutBatch:
        """One batch of a step's samples, in order (a group's samples together). A sample with an
        empty ``loss_mask`` trains on every response token."""
        _check(samples)
        count = len(samples)
        loss_mask = _concat([s.loss_mask or [1] * s.response_length for s in samples], np.uint8)
        return cls(
            tokens=_concat([s.tokens for s in samples], np.int32),
            lengths=torch.tensor([len(s.tokens) for s in samples], dtype=torch.int64),
            response_lengths=torch.tensor([s.response_length for s in samples], dtype=torch.int64),
            loss_mask=loss_mask,
            rollout_log_probs=_concat([s.rollout_log_probs for s in samples], np.float32),
            rewards=torch.tensor([s.reward_value(reward_key) for s in samples], dtype=torch.float64),
            group_ids=torch.tensor([s.group_index for s in samples], dtype=torch.int64),
            sample_ids=torch.tensor([s.index for s in samples], dtype=torch.int64),
            weight_versions=torch.tensor([s.weight_version for s in samples], dtype=torch.int64),
            positions=torch.arange(count, dtype=torch.int64),
            step_size=count,
            step_samples=[count],
            step_tokens=[float(loss_mask.sum())],
            step_seqs=[count],
            routed_experts=_routed_experts(samples),
            token_versions=_concat([s.versions_per_token() for s in samples], np.int64),
            images=_images(samples),
        )

    def shard(self, dp_size: int, samples_per_step: int) -> list[RolloutBatch]:
        """One shard per data-parallel rank. Each optimizer step (``samples_per_step`` consecutive
        samples; the last may have fewer) is dealt out longest first, each sample to the rank
        with the fewest tokens so far: the ranks' forward passes take about as long."""
        count = len(self)
        lengths = self.lengths.tolist()
        trained = self._per_sample_sums(self.loss_mask).tolist()
        rows: list[list[int]] = [[] for _ in range(dp_size)]
        step_samples: list[list[int]] = [[] for _ in range(dp_size)]
        step_tokens, step_seqs = [], []
        for start in range(0, count, samples_per_step):
            step = range(start, min(start + samples_per_step, count))
            if len(step) < dp_size:
                raise ValueError(f"an optimizer step of {len(step)} samples cannot give each of {dp_size} "
                                 "data-parallel ranks one; make trainer.global_batch_size a multiple of the DP size")
            # (tokens so far, rank): the least loaded rank, the lowest of equals, in log(dp) a sample; a scan of
            # every rank a sample grew as samples x DP (0.05 s a step at 1,024 GPUs, docs/scale.md)
            load = [(0, rank) for rank in range(dp_size)]
            mine: list[list[int]] = [[] for _ in range(dp_size)]
            for i in sorted(step, key=lambda i: (-lengths[i], i)):
                tokens, rank = heapq.heappop(load)
                mine[rank].append(i)
                heapq.heappush(load, (tokens + lengths[i], rank))
            for rank in range(dp_size):
                rows[rank] += sorted(mine[rank])
                step_samples[rank].append(len(mine[rank]))
            step_tokens.append(float(sum(trained[i] for i in step)))
            step_seqs.append(len(step))
        shards = []
        for rank in range(dp_size):
            part = self.select(rows[rank])
            part.step_samples, part.step_tokens, part.step_seqs = step_samples[rank], step_tokens, step_seqs
            part.dp_rank = rank
            shards.append(part)
        return shards

    def select(self, rows: Sequence[int]) -> RolloutBatch:
        """The samples at ``rows`` (in that order) as a batch of their own; ``positions`` and
        ``step_size`` still refer to the whole step. Optimizer-step bookkeeping is reset to one step."""
        index = torch.as_tensor(list(rows), dtype=torch.int64)
        token_rows = _ranges(self.offsets(), index)
        response_rows = _ranges(self.response_offsets(), index)
        per_token = {name: getattr(self, name)[response_rows] for name in ("loss_mask", "rollout_log_probs")}
        per_token.update({name: value[response_rows] for name in (*TRAINER_COLUMNS, *ROLLOUT_OPTIONAL_COLUMNS)
                          if (value := getattr(self, name)) is not None})
        per_sample = {name: getattr(self, name)[index] for name in (
            "lengths", "response_lengths", "rewards", "group_ids", "sample_ids", "weight_versions", "positions")}
        trained = float(per_token["loss_mask"].sum())
        if self.routed_experts is not None:
            per_token["routed_experts"] = self.routed_experts[token_rows]
        if self.images is not None:
            per_sample["images"] = [self.images[i] for i in index.tolist()]
        return dataclasses.replace(self, tokens=self.tokens[token_rows], **per_sample, **per_token,
                                   step_samples=[len(index)], step_tokens=[trained], step_seqs=[len(index)])

    # ---------------------------------------------------------------- reading

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def num_response_tokens(self) -> int:
        return len(self.loss_mask)

    def offsets(self) -> Tensor:
        """[B + 1] where each sample's tokens start in ``tokens`` (and the end)."""
        return _offsets(self.lengths)

    def response_offsets(self) -> Tensor:
        """[B + 1] where each sample's response starts in the per-token columns (and the end)."""
        return _offsets(self.response_lengths)

    def optimizer_steps(self) -> Iterator[tuple[RolloutBatch, float, int]]:
        """Each optimizer step's part of this shard, with that step's loss tokens and samples over all shards."""
        start = 0
        for size, tokens, seqs in zip(self.step_samples, self.step_tokens, self.step_seqs, strict=True):
            yield self.select(range(start, start + size)), tokens, seqs
            start += size

    def padded(self, column: Tensor, *, dtype: torch.dtype = torch.float32) -> Tensor:
        """A per-response-token column as ``[B, longest response]``, zeros past each response."""
        mask = self.response_mask()
        out = torch.zeros(mask.shape, dtype=dtype, device=column.device)
        return out.masked_scatter(mask.to(column.device), column.to(dtype))

    def response_mask(self) -> Tensor:
        """``[B, longest response]`` True on real response tokens."""
        longest = int(self.response_lengths.max()) if len(self) else 0
        return torch.arange(longest) < self.response_lengths[:, None]

    def unpad(self, padded: Tensor) -> Tensor:
        """The inverse of `padded`: ``[B, longest]`` -> ``[num_response_tokens]``."""
        return padded[self.response_mask().to(padded.device)]

    def _per_sample_sums(self, column: Tensor) -> Tensor:
        """Sum of a per-token column over each sample's response, ``[B]`` (float64)."""
        ends = self.response_offsets()
        cumulative = torch.cat([torch.zeros(1, dtype=torch.float64), column.to(torch.float64).cumsum(0)])
        return cumulative[ends[1:]] - cumulative[ends[:-1]]

    def tensor_bytes(self) -> int:
        """Bytes of every tensor this batch holds."""
        return sum(t.numel() * t.element_size() for t in vars(self).values() if isinstance(t, Tensor))


def _concat(rows: Sequence[Sequence[float]], dtype: type[np.generic]) -> Tensor:
    """Python lists -> one flat tensor (through numpy: ~4x faster than torch.tensor on a flat list)."""
    if not rows:
        return torch.from_numpy(np.zeros(0, dtype=dtype))
    return torch.from_numpy(np.concatenate([np.asarray(row, dtype=dtype) for row in rows]))


def _offsets(lengths: Tensor) -> Tensor:
    return torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])


def _ranges(offsets: Tensor, rows: Tensor) -> Tensor:
    """Indices ``offsets[r] .. offsets[r + 1] - 1`` for each of ``rows``, concatenated."""
    starts, sizes = offsets[rows], offsets[rows + 1] - offsets[rows]
    if len(rows) == 0:
        return torch.zeros(0, dtype=torch.int64)
    shift = torch.repeat_interleave(starts - _offsets(sizes)[:-1], sizes)
    return torch.arange(int(sizes.sum()), dtype=torch.int64) + shift


def _check(samples: Sequence[Sample]) -> None:
    for s in samples:
        if s.loss_mask and len(s.loss_mask) != s.response_length:
            raise ValueError(f"sample {s.index}: loss_mask has {len(s.loss_mask)} entries for "
                             f"{s.response_length} response tokens")
        if len(s.rollout_log_probs) != s.response_length:
            raise ValueError(f"sample {s.index}: rollout_log_probs has {len(s.rollout_log_probs)} entries for "
                             f"{s.response_length} response tokens")
        if s.response_length > len(s.tokens):
            raise ValueError(f"sample {s.index}: response_length {s.response_length} exceeds its "
                             f"{len(s.tokens)} tokens")


def _routed_experts(samples: Sequence[Sample]) -> Tensor | None:
    """``[T, layers, top-k]`` int16 of the samples' ``rollout_routed_experts`` (None unless every
    sample has them). An engine reports one token fewer (the last is never fed): its row repeats
    the one before, and no log-prob depends on it."""
    if not samples or not all(s.rollout_routed_experts for s in samples):
        return None
    rows = []
    for s in samples:
        routed = torch.as_tensor(s.rollout_routed_experts, dtype=torch.int16)
        if len(routed) == len(s.tokens) - 1:
            routed = torch.cat([routed, routed[-1:]])
        if routed.dim() != 3 or len(routed) != len(s.tokens):
            raise ValueError(f"sample {s.index}: rollout_routed_experts has shape {tuple(routed.shape)}; need"
                             f" [{len(s.tokens)} tokens, layers, top-k]")
        rows.append(routed)
    return torch.cat(rows)


def _images(samples: Sequence[Sample]) -> list[dict[str, Tensor] | None] | None:
    """Each sample's vision inputs (``multimodal_train_inputs``: pixel_values and image_grid_thw, as tensors);
    None when no sample has any."""
    inputs = [s.multimodal_train_inputs or None for s in samples]
    if not any(inputs):
        return None
    return [None if x is None else {k: torch.as_tensor(v) for k, v in x.items()} for x in inputs]
