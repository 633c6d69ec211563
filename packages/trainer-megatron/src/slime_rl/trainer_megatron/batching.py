"""Samples -> this DP rank's micro-batches (padded or packed) and the per-token loss inputs.

Every rank holds the full list of samples. ``dp_shard`` deals them to DP ranks
(balanced by tokens, deterministic); ``micro_batches`` groups a rank's samples
either ``micro_batch_size`` at a time (padded to the longest) or, with a token
budget (``max_tokens_per_gpu``), first-fit-decreasing into packed sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slime_rl.core.sample import Sample
from slime_rl.trainer_megatron.model import PackedSequences, packed_seq_params


@dataclass
class MicroBatch:
    sample_ids: list[int]  # indices into the full sample list, in row order
    input_ids: torch.Tensor  # [b, s] padded, or [1, t] packed
    packed: PackedSequences | None
    hidden_index: torch.Tensor  # [N] rows of hidden.reshape(-1, h) that predict the response tokens
    targets: torch.Tensor  # [N] the response token ids
    response_lengths: list[int]

    @property
    def response_mask(self) -> torch.Tensor:
        """[b, R_max] True on real response positions (row-major order of ``targets``)."""
        lengths = torch.tensor(self.response_lengths)
        return torch.arange(int(lengths.max())) < lengths[:, None]


def check_samples(samples: list[Sample]) -> None:
    for i, s in enumerate(samples):
        if s.response_length < 1:
            raise ValueError(f"samples[{i}] (index {s.index}): response_length is {s.response_length}; need >= 1")
        if s.response_length >= len(s.tokens):
            raise ValueError(
                f"samples[{i}] (index {s.index}): response_length {s.response_length} leaves no prompt token"
                f" in {len(s.tokens)} tokens"
            )


def dp_shard(samples: list[Sample], dp_rank: int, dp_size: int) -> list[int]:
    """Indices of the samples this DP rank trains on: longest first, each to the least-loaded rank."""
    if dp_size == 1:
        return list(range(len(samples)))
    order = sorted(range(len(samples)), key=lambda i: (-len(samples[i].tokens), i))
    loads = [0] * dp_size
    owner = {}
    for i in order:
        rank = min(range(dp_size), key=lambda r: (loads[r], r))
        owner[i] = rank
        loads[rank] += len(samples[i].tokens)
    return [i for i in range(len(samples)) if owner[i] == dp_rank]


def group_ids(samples: list[Sample], ids: list[int], *, micro_batch_size: int, max_tokens: int | None) -> list[list[int]]:
    """Split ``ids`` into micro-batches: by count (sorted by length to limit padding) or by a token budget."""
    by_length = sorted(ids, key=lambda i: (-len(samples[i].tokens), i))
    if max_tokens is None:
        return [by_length[k : k + micro_batch_size] for k in range(0, len(by_length), micro_batch_size)]
    bins: list[list[int]] = []
    room: list[int] = []
    for i in by_length:  # first fit decreasing; a sample over the budget gets a bin of its own
        n = len(samples[i].tokens)
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(max_tokens - n)
    return bins


def collate(samples: list[Sample], ids: list[int], *, packed: bool, device: torch.device) -> MicroBatch:
    seqs = [samples[i].tokens for i in ids]
    resp = [samples[i].response_length for i in ids]
    index, targets = [], []
    if packed:
        offset = 0
        for seq, r in zip(seqs, resp, strict=True):
            start = offset + len(seq) - r - 1  # position predicting the first response token
            index.extend(range(start, start + r))
            targets.extend(seq[len(seq) - r :])
            offset += len(seq)
        input_ids = torch.tensor([[t for seq in seqs for t in seq]], dtype=torch.long)
        params = packed_seq_params([len(s) for s in seqs], device)
    else:
        b, longest = len(seqs), max(len(s) for s in seqs)
        input_ids = torch.zeros(b, longest, dtype=torch.long)
        for j, (seq, r) in enumerate(zip(seqs, resp, strict=True)):
            input_ids[j, : len(seq)] = torch.tensor(seq)
            start = len(seq) - r - 1
            index.extend(pos * b + j for pos in range(start, start + r))  # hidden is [s, b, h]
            targets.extend(seq[len(seq) - r :])
        params = None
    return MicroBatch(
        sample_ids=list(ids),
        input_ids=input_ids.to(device),
        packed=params,
        hidden_index=torch.tensor(index, dtype=torch.long, device=device),
        targets=torch.tensor(targets, dtype=torch.long, device=device),
        response_lengths=resp,
    )


def micro_batches(
    samples: list[Sample], ids: list[int], *, micro_batch_size: int, max_tokens: int | None, device: torch.device
) -> list[MicroBatch]:
    groups = group_ids(samples, ids, micro_batch_size=micro_batch_size, max_tokens=max_tokens)
    return [collate(samples, g, packed=max_tokens is not None, device=device) for g in groups]


def padded_field(samples: list[Sample], mb: MicroBatch, field: str, *, device: torch.device) -> torch.Tensor | None:
    """``[b, R_max]`` float tensor of a per-response-token Sample field (None when any sample lacks it)."""
    rows = [getattr(samples[i], field) for i in mb.sample_ids]
    if any(len(r) == 0 for r in rows):
        return None
    for i, row, r in zip(mb.sample_ids, rows, mb.response_lengths, strict=True):
        if len(row) != r:
            raise ValueError(f"sample {samples[i].index}: {field} has {len(row)} entries for {r} response tokens")
    out = torch.zeros(len(rows), max(mb.response_lengths), dtype=torch.float32)
    for j, row in enumerate(rows):
        out[j, : len(row)] = torch.tensor(row, dtype=torch.float32)
    return out.to(device)


def scatter_padded(flat: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """Per-token values in ``targets`` order -> ``[b, R_max]`` (zeros past each response)."""
    mask = mb.response_mask.to(flat.device)
    out = flat.new_zeros(mask.shape)
    return out.masked_scatter(mask, flat)
