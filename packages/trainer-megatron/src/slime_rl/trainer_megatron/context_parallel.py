"""Context parallelism (``parallel.context_parallel_size`` = CP) without TransformerEngine.

Each sequence of a packed micro-batch is padded to a multiple of ``2 * CP`` and cut into ``2 * CP``
equal chunks; CP rank ``r`` holds chunks ``r`` and ``2 * CP - 1 - r`` of every sequence, so that each
rank does the same causal-attention work (an early chunk sees a short prefix, its partner a long one).
Padding sits at the end of a sequence, past every real token, so causal attention keeps it out of
every real token (MoE routers do see it: at most ``2 * CP - 1`` tokens a sequence).

Attention: K and V are all-gathered over the CP group (GQA keeps them small; the backward pass
reduce-scatters their gradients), and each of the rank's query chunks attends to its sequence's
prefix up to the chunk's end. On CUDA that is one flash varlen call per layer: ``cu_seqlens_q`` over
the rank's chunks, ``cu_seqlens_k`` over the prefixes, with flash's causal mask aligned to the bottom
right when a chunk has fewer queries than keys. Elsewhere one SDPA call over the chunks padded to a
batch, with that mask made explicit (torch's ``is_causal`` aligns top-left).

RoPE: every token keeps its position in its own sequence (Megatron's thd RoPE reads the padded full
lengths from ``cu_seqlens_q_padded``; ``fused_rope.rope_thd`` uses ``local_positions``). Log-probs,
entropy and values: each rank computes them for the positions it holds (the targets come from the
whole sequence) and ``gather_tokens`` hands every rank the micro-batch's full vector, so the losses
run unchanged on every CP rank; its backward keeps the rank's own slice of the (identical) upstream
gradient, and Megatron's DDP sums parameter gradients over data-parallel x context-parallel ranks.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F


@dataclass
class ContextParallelSplit:
    """How one CP rank holds the sequences of one packed micro-batch (host-side, built once per micro-batch)."""

    size: int
    rank: int
    seq_lens: tuple[int, ...]  # real tokens of each sequence
    padded_lens: tuple[int, ...]  # each a multiple of 2 * size
    _device: dict = field(default_factory=dict, repr=False)

    @property
    def chunk_lens(self) -> list[int]:
        return [n // (2 * self.size) for n in self.padded_lens]

    @property
    def local_tokens(self) -> int:
        """Tokens each CP rank holds (the same on every rank)."""
        return sum(self.padded_lens) // self.size

    def local_rows(self, rank: int | None = None) -> torch.Tensor:
        """Rows of the full padded packed layout (sequences of ``padded_lens`` back to back) that ``rank``
        holds, in its order: for each sequence its early chunk, then its late chunk."""
        rank = self.rank if rank is None else rank
        starts = itertools.accumulate(self.padded_lens, initial=0)
        parts = []
        for start, c in zip(starts, self.chunk_lens, strict=False):
            late = 2 * self.size - 1 - rank
            parts += [torch.arange(start + rank * c, start + (rank + 1) * c),
                      torch.arange(start + late * c, start + (late + 1) * c)]
        return torch.cat(parts)

    def key_rows(self) -> torch.Tensor:
        """Rows of the all-gathered ``[size * local_tokens]`` K/V (rank ``s``'s tokens at rows
        ``s * local_tokens ...``) that make each of this rank's query chunks' key prefix, in chunk order."""
        holder_row = torch.empty(sum(self.padded_lens), dtype=torch.int64)
        for s in range(self.size):
            holder_row[self.local_rows(s)] = torch.arange(self.local_tokens) + s * self.local_tokens
        starts = itertools.accumulate(self.padded_lens, initial=0)
        parts = []
        for start, end in zip(starts, self._key_ends(), strict=False):
            parts += [holder_row[start : start + end[0]], holder_row[start : start + end[1]]]
        return torch.cat(parts)

    def _key_ends(self) -> list[tuple[int, int]]:
        """Per sequence, the end (exclusive, in the sequence) of the early and the late chunk."""
        r, late = self.rank, 2 * self.size - 1 - self.rank
        return [((r + 1) * c, (late + 1) * c) for c in self.chunk_lens]

    def varlen_bounds(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """``cu_seqlens_q``, ``cu_seqlens_k`` (int32 on ``device``), ``max_q``, ``max_k`` of the chunks."""
        if device not in self._device:
            q_lens = [c for c in self.chunk_lens for _ in range(2)]
            k_lens = [end for ends in self._key_ends() for end in ends]
            cu_q = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
            cu_k = torch.tensor([0, *itertools.accumulate(k_lens)], dtype=torch.int32)
            self._device[device] = (cu_q.to(device), cu_k.to(device), max(q_lens), max(k_lens),
                                    self.key_rows().to(device))
        return self._device[device][:4]

    def key_rows_on(self, device: torch.device) -> torch.Tensor:
        self.varlen_bounds(device)
        return self._device[device][4]


def split_sequences(seq_lens: list[int], size: int, rank: int) -> ContextParallelSplit:
    unit = 2 * size
    padded = tuple(-(-n // unit) * unit for n in seq_lens)
    return ContextParallelSplit(size=size, rank=rank, seq_lens=tuple(seq_lens), padded_lens=padded)


def local_positions(padded_cu: torch.Tensor, size: int, rank: int) -> torch.Tensor:
    """Each local token's position in its own sequence, from the cumulative padded full lengths
    (Megatron's convention for thd RoPE under CP, which ``cu_seqlens_q_padded`` carries)."""
    cu = padded_cu.long()
    full = cu.diff()
    chunk, local = full // (2 * size), full // size
    starts = torch.cumsum(local, 0) - local
    k = torch.arange(int(local.sum()), device=cu.device) - torch.repeat_interleave(starts, local)
    c, n = torch.repeat_interleave(chunk, local), torch.repeat_interleave(full, local)
    return torch.where(k < c, rank * c + k, n - (rank + 2) * c + k)


# ---------------------------------------------------------------- collectives with their gradients


class _AllGatherRows(torch.autograd.Function):
    """``[t, ...]`` on each rank -> ``[size * t, ...]``, rank order; backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        size = dist.get_world_size(group)
        out = x.new_empty(size * x.shape[0], *x.shape[1:])
        dist.all_gather(list(out.chunk(size)), x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        group = ctx.group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        grad = grad.contiguous()
        if dist.get_backend(group) == "nccl":
            mine = grad.new_empty(grad.shape[0] // size, *grad.shape[1:])
            dist.reduce_scatter_tensor(mine, grad, group=group)
            return mine, None
        grad = grad.clone()  # gloo has no reduce-scatter: all-reduce a copy, keep this rank's slice
        dist.all_reduce(grad, group=group)
        return grad.chunk(size)[rank].contiguous(), None


@dataclass(frozen=True)
class TokenGather:
    """Per-token results of a micro-batch spread over its CP ranks: ``counts[s]`` entries on rank ``s``;
    ``rows[n]``: where entry ``n`` (the micro-batch's targets order) lies in the gathered buffer."""

    counts: tuple[int, ...]
    rows: torch.Tensor


class _GatherTokens(torch.autograd.Function):
    """This rank's per-token values -> the micro-batch's, on every CP rank. Every CP rank then computes the
    same loss from them, so the backward keeps this rank's slice of the gradient as it is (no sum)."""

    @staticmethod
    def forward(ctx, x, plan: TokenGather, group):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        most = max(plan.counts)
        padded = x.new_zeros(most, *x.shape[1:])
        padded[: x.shape[0]] = x
        pieces = x.new_empty(size * most, *x.shape[1:])
        dist.all_gather(list(pieces.chunk(size)), padded, group=group)
        rows = plan.rows.to(x.device)
        ctx.rows, ctx.start, ctx.count, ctx.total = rows, rank * most, x.shape[0], size * most
        return pieces[rows]

    @staticmethod
    def backward(ctx, grad):
        full = grad.new_zeros(ctx.total, *grad.shape[1:])
        full.index_copy_(0, ctx.rows, grad)
        return full[ctx.start : ctx.start + ctx.count], None, None


def gather_tokens(x: torch.Tensor | None, plan: TokenGather | None) -> torch.Tensor | None:
    """``x`` (this rank's entries) as the micro-batch's whole vector; ``x`` itself without CP."""
    if x is None or plan is None:
        return x
    from megatron.core import parallel_state

    return _GatherTokens.apply(x, plan, parallel_state.get_context_parallel_group())


# ---------------------------------------------------------------- attention


def attention(query, key, value, split: ContextParallelSplit, scale: float, *, use_varlen: bool):
    """Causal attention of this rank's query chunks over their sequences' prefixes, ``[t, heads, dim]``
    each (K/V may have fewer heads) -> ``[t, heads, dim]``; K and V are gathered over the CP group."""
    from megatron.core import parallel_state

    group = parallel_state.get_context_parallel_group()
    rows = split.key_rows_on(key.device)
    keys = _AllGatherRows.apply(key, group).index_select(0, rows)
    values = _AllGatherRows.apply(value, group).index_select(0, rows)
    return attend_chunks(query, keys, values, split, scale, use_varlen=use_varlen)


def attend_chunks(query, keys, values, split: ContextParallelSplit, scale: float, *, use_varlen: bool):
    """The math of ``attention`` once K/V are gathered: ``keys``/``values`` hold each query chunk's prefix
    back to back (``split.key_rows``). Collective-free, so one process can check it for simulated ranks."""
    cu_q, cu_k, max_q, max_k = split.varlen_bounds(query.device)
    if use_varlen:
        from slime_rl.trainer_megatron.attention import varlen_attention

        return varlen_attention(query, keys, values, cu_q, cu_k, max_q, max_k, scale)
    return _masked_attention(query, keys, values, cu_q.tolist(), cu_k.tolist(), max_q, max_k, scale)


def _masked_attention(query, keys, values, cu_q, cu_k, max_q, max_k, scale):
    """All chunks in one SDPA call, padded to ``[chunks, max_q]`` x ``[chunks, max_k]``: query ``i`` of a
    chunk of ``q`` queries over ``k`` keys sees keys ``<= k - q + i`` (bottom-right causal)."""
    count = len(cu_q) - 1
    q_lens = torch.tensor(cu_q).diff()
    k_lens = torch.tensor(cu_k).diff()
    q_index = _padded_index(q_lens, max_q)
    k_index = _padded_index(k_lens, max_k)
    rep = query.shape[1] // keys.shape[1]
    if rep > 1:
        keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)

    def padded(x, index, longest):
        rows = x.new_zeros(count * longest, *x.shape[1:])
        rows[index.to(x.device)] = x
        return rows.view(count, longest, *x.shape[1:]).transpose(1, 2)  # [chunks, heads, len, dim]

    q, k, v = padded(query, q_index, max_q), padded(keys, k_index, max_k), padded(values, k_index, max_k)
    i, j = torch.arange(max_q)[:, None], torch.arange(max_k)[None, :]
    offset = (k_lens - q_lens)[:, None, None]
    mask = (j <= i + offset) & (j < k_lens[:, None, None])  # padded queries still see a key: no nan
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None].to(query.device), scale=scale)
    return out.transpose(1, 2).reshape(count * max_q, *out.shape[1:2], out.shape[-1])[q_index.to(query.device)]


def _padded_index(lens: torch.Tensor, longest: int) -> torch.Tensor:
    return torch.cat([torch.arange(int(n)) + b * longest for b, n in enumerate(lens.tolist())])
