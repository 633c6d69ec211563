"""A data-parallel shard (`RolloutBatch`) -> this rank's micro-batches (padded or packed) and the
per-token loss inputs.

``micro_batches`` groups the shard's samples either ``micro_batch_size`` at a time (sorted by
length, padded to the longest) or, with a token budget (``max_tokens_per_gpu``), into as many
packed sequences as first-fit-decreasing needs, balanced by compute. The model's inputs and the
per-token gathers are built with tensor ops from the shard's flat ``tokens`` and offsets: no
per-token Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from slime_rl.core.batch import RolloutBatch
from slime_rl.trainer_megatron.attention import PackedSequences, packed_seq_params
from slime_rl.trainer_megatron.context_parallel import TokenGather, split_sequences


@dataclass
class MicroBatch:
    rows: Tensor  # [b] int64: the shard's samples in this micro-batch, in row order (CPU)
    response_index: Tensor  # [N] int64: where the rows' response tokens sit in the shard's per-token columns (CPU)
    response_mask: Tensor  # [b, R_max] True on real response positions (row-major order of ``targets``; CPU)
    input_ids: Tensor  # [b, s] padded, or [1, t] packed
    packed: PackedSequences | None
    hidden_index: Tensor  # [N] rows of hidden.reshape(-1, h) that predict the response tokens
    targets: Tensor  # [N] the response token ids
    # routing replay: the engine's experts for each token the model sees, in the router's order
    # (``[s * b, layers, top-k]`` padded, ``[t, layers, top-k]`` packed); None without replay
    routed_experts: Tensor | None = None
    # context parallelism: ``input_ids`` hold this CP rank's chunks, ``hidden_index`` and ``targets`` its own
    # predicting positions; this puts their per-token results back in the micro-batch's order
    cp_gather: TokenGather | None = None
    # sequence parallelism: how many of this TP rank's tokens are not the padding for TP (sequence_parallel.py)
    sp_real_tokens: int | None = None
    # a vision-language model (vlm.py): the (t, h, w) mRoPE positions ``[3, b, s]`` and the model's other inputs
    # (``images``); None and {} for a text model
    position_ids: Tensor | None = None
    model_inputs: dict = field(default_factory=dict)


def check_batch(batch: RolloutBatch) -> None:
    """Every sample has a response and at least one prompt token (the first response token needs a predictor)."""
    bad = (batch.response_lengths < 1) | (batch.response_lengths >= batch.lengths)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        length, response = int(batch.lengths[i]), int(batch.response_lengths[i])
        what = (f"response_length is {response}; need >= 1" if response < 1 else
                f"response_length {response} leaves no prompt token in {length} tokens")
        raise ValueError(f"batch row {i} (sample {int(batch.sample_ids[i])}): {what}")


def sample_costs(lengths: list[int], attention_weight: float = 0.0) -> list[float]:
    """Relative compute of each sample: its tokens, plus causal attention's share, which grows with
    the sample's own length (``attention_weight``: model.attention_cost_weight; 0 counts tokens only)."""
    return [n * (1.0 + attention_weight * n) for n in lengths]


def group_rows(lengths: list[int], *, micro_batch_size: int, max_tokens: int | None,
               attention_weight: float = 0.0) -> list[list[int]]:
    """Split rows ``0..len(lengths)-1`` into micro-batches: by count (sorted by length to limit
    padding) or by a token budget. With a budget: as few micro-batches as first-fit-decreasing packs,
    with the samples dealt out costliest first, each to the micro-batch of least cost that still has
    room, so that no micro-batch (and no pipeline stage waiting on it) holds a long tail of work the
    others do not. A sample over the budget gets a micro-batch of its own."""
    by_length = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if max_tokens is None:
        return [by_length[k : k + micro_batch_size] for k in range(0, len(by_length), micro_batch_size)]
    packed = _first_fit_decreasing(lengths, by_length, max_tokens)
    costs = sample_costs(lengths, attention_weight)
    bins: list[list[int]] = [[] for _ in packed]
    room, load = [max_tokens] * len(packed), [0.0] * len(packed)
    for i in sorted(range(len(lengths)), key=lambda i: (-costs[i], i)):
        fits = [b for b in range(len(bins)) if lengths[i] <= room[b] or not bins[b]]
        if not fits:
            return packed  # balancing would need another micro-batch: fewer, fuller ones win
        b = min(fits, key=lambda b: (load[b], b))
        bins[b].append(i)
        room[b] -= lengths[i]
        load[b] += costs[i]
    return bins


def _first_fit_decreasing(lengths: list[int], by_length: list[int], max_tokens: int) -> list[list[int]]:
    bins: list[list[int]] = []
    room: list[int] = []
    for i in by_length:
        n = lengths[i]
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(max_tokens - n)
    return bins


def imbalance(groups: list[list[int]], costs: list[float]) -> float:
    """The costliest micro-batch over the mean one (1.0: even)."""
    loads = [sum(costs[i] for i in g) for g in groups]
    return max(loads) / (sum(loads) / len(loads)) if loads and sum(loads) else 1.0


def collate(batch: RolloutBatch, rows: list[int], *, packed: bool, device: torch.device,
            context_parallel: tuple[int, int] = (1, 0)) -> MicroBatch:
    """The model's inputs for ``rows`` of ``batch``; the hidden state at position p predicts token p + 1.
    ``context_parallel``: (CP size, this rank's CP rank); packed only."""
    index = torch.tensor(rows, dtype=torch.int64)
    lengths, responses = batch.lengths[index], batch.response_lengths[index]
    count, longest = len(rows), int(lengths.max())
    columns = torch.arange(longest)
    real = columns < lengths[:, None]  # [b, L] the rows' tokens, row-major as they lie in ``tokens``
    token_rows = (batch.offsets()[index][:, None] + columns)[real]
    ids = batch.tokens[token_rows].long()
    prompts = lengths - responses
    # positions prompt-1 .. length-2 predict the response tokens
    predicts = (columns >= (prompts - 1)[:, None]) & (columns < (lengths - 1)[:, None])
    if packed:
        input_ids = ids[None]
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
        hidden_index = (starts[:, None] + columns)[predicts]
        targets = ids[hidden_index + 1]
        params = packed_seq_params(lengths.tolist())
    else:
        input_ids = torch.zeros(count, longest, dtype=torch.long)
        input_ids[real] = ids
        hidden_index = (columns * count + torch.arange(count)[:, None])[predicts]  # hidden is [s, b, h]
        targets = input_ids[:, 1:][predicts[:, :-1]]
        params = None
    widest = int(responses.max())
    response_mask = torch.arange(widest) < responses[:, None]
    response_index = (batch.response_offsets()[index][:, None] + torch.arange(widest))[response_mask]
    routed = None
    if batch.routed_experts is not None:
        routed = _routed_in_layout(batch.routed_experts, token_rows, real, packed=packed)
    cp_gather = None
    if context_parallel[0] > 1:
        if not packed:
            raise ValueError("parallel.context_parallel_size: > 1 needs packed micro-batches; set"
                             " trainer.max_tokens_per_gpu")
        input_ids, params, hidden_index, targets, routed, cp_gather = _split_over_cp(
            ids, lengths.tolist(), hidden_index, targets, routed, *context_parallel)
    return MicroBatch(
        cp_gather=cp_gather,
        routed_experts=routed,
        rows=index,
        response_index=response_index,
        response_mask=response_mask,
        input_ids=input_ids.to(device),
        packed=params,
        hidden_index=hidden_index.to(device),
        targets=targets.to(device),
    )


def _routed_in_layout(routed: Tensor, token_rows: Tensor, real: Tensor, *, packed: bool) -> Tensor:
    """The batch's ``[T, layers, k]`` routed experts for a micro-batch, in the order the router sees
    its tokens: packed rows as they are; padded ``[b, s]`` as ``[s, b]`` flattened, with padding
    routed to experts 0..k-1 (causal attention keeps padding out of every real token)."""
    mine = routed[token_rows].long()
    if packed:
        return mine
    count, longest = real.shape
    k = routed.shape[-1]
    out = torch.arange(k).expand(count, longest, routed.shape[1], k).clone()
    out[real] = mine
    return out.transpose(0, 1).reshape(longest * count, routed.shape[1], k)


def _split_over_cp(ids: Tensor, lengths: list[int], hidden_index: Tensor, targets: Tensor,
                   routed: Tensor | None, size: int, rank: int):
    """A packed micro-batch's inputs cut down to CP rank ``rank``'s chunks (context_parallel.py): its
    input ids, thd parameters, predicting rows and targets, routed experts, and the per-token gather."""
    split = split_sequences(lengths, size, rank)
    total = sum(split.padded_lens)
    real_starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
    padded_starts = torch.tensor([0, *split.padded_lens[:-1]]).cumsum(0)
    shift = torch.repeat_interleave(padded_starts - real_starts, torch.tensor(lengths))
    padded_row = torch.arange(len(ids)) + shift  # each real token's row in the padded layout
    holder, local_row = torch.empty(total, dtype=torch.int64), torch.empty(total, dtype=torch.int64)
    for s in range(size):
        rows = split.local_rows(s)
        holder[rows], local_row[rows] = s, torch.arange(len(rows))
    padded_ids = torch.zeros(total, dtype=ids.dtype)
    padded_ids[padded_row] = ids
    mine = split.local_rows()
    predictor = padded_row[hidden_index]
    owner = holder[predictor]
    counts = torch.bincount(owner, minlength=size)
    most = int(counts.max())
    gather_rows = torch.empty(len(owner), dtype=torch.int64)
    for s in range(size):
        at = (owner == s).nonzero().squeeze(1)
        gather_rows[at] = s * most + torch.arange(len(at))
    own = owner == rank
    if routed is not None:  # padding goes to experts 0..k-1, as in the padded layout
        k = routed.shape[-1]
        full = torch.arange(k).expand(total, routed.shape[1], k).clone()
        full[padded_row] = routed
        routed = full[mine]
    return (padded_ids[mine][None], packed_seq_params(lengths, split), local_row[predictor[own]], targets[own],
            routed, TokenGather(counts=tuple(counts.tolist()), rows=gather_rows))


def split_to_count(groups: list[list[int]], lengths: list[int], count: int) -> list[list[int]]:
    """``groups`` split further (the one with the most tokens, in halves) until there are ``count``.
    Expert parallelism needs it: every rank of an EP group must run as many micro-batches (each
    MoE layer's all-to-all is collective) even when their shards pack differently."""
    groups = [list(g) for g in groups]
    while len(groups) < count:
        splittable = [i for i, g in enumerate(groups) if len(g) > 1]
        if not splittable:
            raise ValueError(f"expert parallelism: {len(groups)} samples on this rank cannot make the {count}"
                             " micro-batches another rank of its expert-parallel group runs; give each"
                             " data-parallel rank more samples (trainer.global_batch_size) or lower"
                             " trainer.micro_batch_size / raise trainer.max_tokens_per_gpu")
        i = max(splittable, key=lambda j: (sum(lengths[r] for r in groups[j]), -j))
        g = groups.pop(i)
        half = len(g) // 2
        groups[i:i] = [g[:half], g[half:]]
    return groups


def micro_batches(batch: RolloutBatch, *, micro_batch_size: int, max_tokens: int | None,
                  device: torch.device, count_at_least=None, attention_weight: float = 0.0,
                  context_parallel: tuple[int, int] = (1, 0)) -> list[MicroBatch]:
    """All of ``batch``'s samples as micro-batches. ``count_at_least(n) -> m``: the number the
    caller needs (m >= n, the same on every rank of an expert-parallel group), reached by splitting.
    ``context_parallel`` (CP size, CP rank): ``max_tokens`` is per CP rank, so a micro-batch packs up to
    CP times as many tokens (counted with each sequence's padding to a multiple of 2 * CP), each of its
    sequences split over the CP ranks."""
    lengths = batch.lengths.tolist()
    size = context_parallel[0]
    budget = max_tokens * size if max_tokens is not None else None
    if size > 1:  # what each sequence takes once padded for its 2 * CP chunks
        lengths = [-(-n // (2 * size)) * 2 * size for n in lengths]
    groups = group_rows(lengths, micro_batch_size=micro_batch_size, max_tokens=budget,
                        attention_weight=attention_weight)
    if count_at_least is not None:
        groups = split_to_count(groups, lengths, count_at_least(len(groups)))
    return [collate(batch, g, packed=max_tokens is not None, device=device, context_parallel=context_parallel)
            for g in groups]


def padded_field(column: Tensor | None, mb: MicroBatch, *, device: torch.device) -> Tensor | None:
    """A per-response-token column of the shard (``[num_response_tokens]``) as ``[b, R_max]`` float32
    for the micro-batch's rows, zeros past each response; None for an absent column."""
    if column is None:
        return None
    out = torch.zeros(mb.response_mask.shape, dtype=torch.float32)
    return out.masked_scatter_(mb.response_mask, column[mb.response_index].float()).to(device)


def scatter_padded(flat: Tensor, mb: MicroBatch) -> Tensor:
    """Per-token values in ``targets`` order -> ``[b, R_max]`` (zeros past each response)."""
    mask = mb.response_mask.to(flat.device)
    out = flat.new_zeros(mask.shape)
    return out.masked_scatter(mask, flat)
