"""Core attention for the Megatron trainer: causal, GQA, padded (``sbhd``) or packed (``thd``).

An RL micro-batch packs many sequences of very different lengths into one row. Attention must
stay inside each sequence, and how it runs decides the step's speed (docs/trainer-performance.md):

- ``varlen`` (CUDA, bf16/fp16): one flash-attention call for the whole packed row per layer,
  forward and backward (``torch.nn.attention.varlen.varlen_attn``), K/V heads left unrepeated; V of a
  smaller head dim (MLA's) is zero-padded to the q/k dim and the output's extra columns sliced off.
- ``padded``: the packed rows are scattered into a ``[batch, longest]`` layout for one SDPA call,
  where padding stays small (per-call overhead dominates short sequences; the CPU has no varlen).
- ``per_sequence``: one SDPA call per sequence; exact work, no padding, but a launch-bound
  Python loop (3,840 attention calls per step for 128 short samples and 30 layers): the last resort.

``trainer.megatron.packed_attention`` picks one; ``auto`` takes the first that applies in that order.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention

from slime_rl.trainer_megatron import context_parallel
from slime_rl.trainer_megatron.context_parallel import ContextParallelSplit

PackedKernel = Literal["varlen", "padded", "per_sequence"]
PACKED_ATTENTION_CHOICES = ("auto", "varlen", "padded", "per_sequence")
_CPU_MATMUL_ATTENTION_BYTES = 64 << 20  # fp32 scores of one call
# Without varlen, pad while batch x longest <= this x the packed tokens. CPU, fp32, one layer forward and
# backward (benchmarks/packed_attention.py): 128 x ~40 tokens (1.1x padding) padded is 3.7x faster than per
# sequence; 32 x 50-4,000 (2.4x padding) 3.3x slower.
_PADDING_ALLOWED = 2.0


@dataclass
class PackedSequences(PackedSeqParams):
    """Megatron's thd packing parameters plus what our attention derives from them, built once per
    micro-batch (not per layer): the offsets on the device for varlen, and where each packed token
    sits in a padded ``[batch, longest]`` layout for the padded kernel."""

    seq_lens: tuple[int, ...] = ()
    # parallel.context_parallel_size > 1: this rank's chunks of the sequences (context_parallel.py);
    # cu_seqlens_q_padded then holds the padded full lengths, for Megatron's RoPE
    context_parallel: ContextParallelSplit | None = None
    _device_cu: dict = field(default_factory=dict, repr=False)
    _pad_index: dict = field(default_factory=dict, repr=False)

    def cu_seqlens_on(self, device: torch.device) -> torch.Tensor:
        if device not in self._device_cu:
            self._device_cu[device] = self.cu_seqlens_q.to(device=device, dtype=torch.int32, non_blocking=True)
        return self._device_cu[device]

    def pad_index(self, device: torch.device) -> torch.Tensor:
        """Row of each packed token in the flattened ``[batch, longest]`` layout."""
        if device not in self._pad_index:
            # token t of sequence j sits at j * longest + (t - start of j): no loop over sequences
            lens = torch.tensor(self.seq_lens)
            starts = torch.arange(len(lens)) * self.max_seqlen_q - (lens.cumsum(0) - lens)
            index = torch.arange(int(lens.sum())) + starts.repeat_interleave(lens)
            self._pad_index[device] = index.to(device)
        return self._pad_index[device]

    @property
    def padded_tokens(self) -> int:
        return len(self.seq_lens) * self.max_seqlen_q


def packed_seq_params(seq_lens: list[int], split: ContextParallelSplit | None = None) -> PackedSequences:
    """thd parameters for sequences of ``seq_lens`` packed into one row. ``cu_seqlens`` stay on the
    host: RoPE and the padded and per-sequence kernels read them as Python numbers; varlen takes a
    device copy made once per micro-batch. With a context-parallel ``split``, the cu_seqlens (padded
    too, which Megatron's RoPE prefers) are those of the padded full sequences, of which this rank
    holds two chunks each."""
    if split is not None:
        cu = torch.tensor([0, *itertools.accumulate(split.padded_lens)], dtype=torch.int32)
        longest = max(split.padded_lens)
        return PackedSequences(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                               cu_seqlens_kv_padded=cu, max_seqlen_q=longest, max_seqlen_kv=longest,
                               seq_lens=tuple(seq_lens), context_parallel=split)
    cu = torch.tensor([0, *itertools.accumulate(seq_lens)], dtype=torch.int32)
    longest = max(seq_lens)
    return PackedSequences(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                           max_seqlen_kv=longest, seq_lens=tuple(seq_lens))


# ---------------------------------------------------------------- varlen (flash) on CUDA


@functools.cache
def _varlen_function():
    """torch's ``varlen_attn`` and the names of its keyword arguments, or None where torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


# K/V with fewer heads than Q: torch 2.13 says so with ``enable_gqa``; older releases have no flag, and
# whether their flash kernel takes unrepeated K/V is learnt on the first call (None: not yet known).
_GQA_WITHOUT_FLAG: bool | None = None


def varlen_causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: PackedSequences,
                  scale: float) -> torch.Tensor:
    """Causal attention within each packed sequence in one flash call: ``[t, heads, dim]`` each (K/V may
    have fewer heads; V a smaller head dim, as MLA's) -> ``[t, heads, v dim]``."""
    cu = params.cu_seqlens_on(query.device)
    v_dim = value.shape[-1]
    if v_dim < query.shape[-1]:
        # MLA (q/k 192, v 128 in DeepSeek-V3): flash takes one head dim for q, k and v; zero columns of V give
        # zero output columns, sliced off (the extra work is V's share of the attention matmuls)
        value = F.pad(value, (0, query.shape[-1] - v_dim))
    out = varlen_attention(query, key, value, cu, cu, params.max_seqlen_q, params.max_seqlen_kv, scale)
    return out[..., :v_dim]


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_q: torch.Tensor,
                     cu_k: torch.Tensor, max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """One flash varlen call, causal; where a segment has fewer queries than keys (context parallelism's
    chunks), flash aligns the mask bottom-right: the queries are the segment's last ones. Adapts to the
    varlen signature of the torch at hand."""
    global _GQA_WITHOUT_FLAG
    function, names = _varlen_function()
    kwargs = {}
    if "window_size" in names:  # torch >= 2.11: causal is a window reaching back without limit
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    if "scale" in names:
        kwargs["scale"] = scale
    elif not math.isclose(scale, query.shape[-1] ** -0.5, rel_tol=1e-6):
        query = query * (scale * query.shape[-1] ** 0.5)  # the kernel's own scale is 1/sqrt(dim)
    q, k, v = (x.contiguous() for x in (query, key, value))
    rep = q.shape[1] // k.shape[1]
    call = functools.partial(function, cu_seq_q=cu_q, cu_seq_k=cu_k, max_q=max_q, max_k=max_k, **kwargs)
    if rep == 1:
        return call(q, k, v)
    if "enable_gqa" in names:
        return call(q, k, v, enable_gqa=True)
    if _GQA_WITHOUT_FLAG is not False:
        try:
            out = call(q, k, v)
            _GQA_WITHOUT_FLAG = True
            return out
        except RuntimeError:
            if _GQA_WITHOUT_FLAG:
                raise
            _GQA_WITHOUT_FLAG = False
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return call(q, k, v)


def choose_packed_kernel(setting: str, query: torch.Tensor, params: PackedSequences, dropout: float) -> PackedKernel:
    """The kernel for a packed micro-batch: ``setting`` itself, or for ``auto`` the fastest that applies."""
    if setting != "auto":
        if setting == "varlen" and not varlen_applies(query, dropout):
            raise ValueError(
                "trainer.megatron.packed_attention: varlen needs CUDA, bf16 or fp16, no attention dropout and a"
                f" torch with torch.nn.attention.varlen (here: {query.device.type}, {query.dtype}, torch"
                f" {torch.__version__}); set it to auto")
        return setting  # type: ignore[return-value]
    if varlen_applies(query, dropout):
        return "varlen"
    if params.padded_tokens <= _PADDING_ALLOWED * query.shape[0]:
        return "padded"
    return "per_sequence"


def varlen_applies(query: torch.Tensor, dropout: float) -> bool:
    return (query.device.type == "cuda" and query.dtype in (torch.bfloat16, torch.float16) and dropout == 0.0
            and query.shape[-1] <= 256 and _varlen_function() is not None)


# ---------------------------------------------------------------- the attention module


class SDPAttention(DotProductAttention):
    """Core attention over flash varlen (packed, CUDA) or torch's scaled_dot_product_attention, causal,
    with GQA. Padded batches (``[s, b, heads, dim]``) use ``is_causal`` (right padding never reaches a
    real token); packed batches (``thd``) attend within each sequence by the kernel the module
    docstring describes, or with context parallelism over the CP group (context_parallel.py)."""

    def __init__(self, config, *args, **kwargs):
        # megatron's DotProductAttention asserts CP == 1 (its CP is TransformerEngine's); ours is in forward
        cp = config.context_parallel_size
        config.context_parallel_size = 1
        try:
            super().__init__(config, *args, **kwargs)
        finally:
            config.context_parallel_size = cp

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        assert attention_bias is None, "attention bias is not supported"
        dropout = self.attention_dropout.p if self.training else 0.0
        gqa = self.num_attention_heads_per_partition != self.num_query_groups_per_partition
        if packed_seq_params is None:
            return self._padded(query, key, value, dropout, gqa)
        params = packed_seq_params  # thd: [t, heads, dim]
        setting = getattr(self.config, "packed_attention", "auto")
        if params.context_parallel is not None:
            assert dropout == 0.0, "context parallelism: attention dropout is not supported"
            use_varlen = setting in ("auto", "varlen") and varlen_applies(query, dropout)
            if setting == "varlen" and not use_varlen:
                choose_packed_kernel(setting, query, params, dropout)  # raises, naming the fix
            out = context_parallel.attention(query, key, value, params.context_parallel, self.softmax_scale,
                                             use_varlen=use_varlen)
            return out.reshape(query.shape[0], -1)
        kernel = choose_packed_kernel(setting, query, params, dropout)
        if kernel == "varlen":
            return varlen_causal(query, key, value, params, self.softmax_scale).reshape(query.shape[0], -1)
        if kernel == "padded":
            index = params.pad_index(query.device)
            b, s = len(params.seq_lens), params.max_seqlen_q
            padded = []
            for x in (query, key, value):
                rows = x.new_zeros(b * s, *x.shape[1:])
                rows[index] = x
                padded.append(rows.view(b, s, *x.shape[1:]).transpose(0, 1))  # [s, b, heads, dim]
            out = self._padded(*padded, dropout, gqa)  # [s, b, heads * dim]
            return out.transpose(0, 1).reshape(b * s, -1)[index]
        q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (query, key, value))  # [1, heads, t, dim]
        bounds = params.cu_seqlens_q.tolist()
        out = torch.cat(
            [
                self._sdpa(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True, dropout=dropout, gqa=gqa)
                for a, b in zip(bounds[:-1], bounds[1:], strict=True)
            ],
            dim=2,
        )
        return out.squeeze(0).transpose(0, 1).reshape(query.shape[0], -1)

    def _padded(self, query, key, value, dropout, gqa):
        # [s, b, heads, dim] -> [b, heads, s, dim] -> attention -> [s, b, heads * dim]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        out = self._sdpa(q, k, v, is_causal=True, dropout=dropout, gqa=gqa)
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)

    def _sdpa(self, q, k, v, *, is_causal: bool, dropout: float = 0.0, gqa: bool = False):
        if q.device.type == "cpu" and q.dtype == torch.bfloat16 and dropout == 0.0 and is_causal:
            scores_bytes = 4 * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
            if scores_bytes <= _CPU_MATMUL_ATTENTION_BYTES:
                return self._matmul_attention(q, k, v)
        if gqa and q.device.type == "cuda":
            # enable_gqa is not served by every CUDA kernel; expanding keeps flash attention in play.
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            gqa = False
        kwargs = dict(is_causal=is_causal, dropout_p=dropout, scale=self.softmax_scale)
        if gqa:
            kwargs["enable_gqa"] = True
        if dropout > 0:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return F.scaled_dot_product_attention(q, k, v, **kwargs)
        return F.scaled_dot_product_attention(q, k, v, **kwargs)

    def _matmul_attention(self, q, k, v):
        """bf16 on the CPU, short sequences: two AMX matmuls around an fp32 softmax. torch's CPU
        flash kernel is several times slower than this in bf16 backward at RL-rollout lengths
        (fp32 is served well by SDPA); long sequences go to SDPA, which never holds all scores."""
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * self.softmax_scale
        s = q.shape[-2]
        future = torch.ones(s, s, dtype=torch.bool, device=q.device).triu_(1)
        scores = scores.masked_fill_(future, float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)
