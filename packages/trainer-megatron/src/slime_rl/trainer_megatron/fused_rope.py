"""RoPE as one compiled kernel per call, where Megatron would use TransformerEngine's.

With ``apply_rope_fusion`` Megatron calls ``rope_utils.fused_apply_rotary_pos_emb`` (and its
``_thd`` twin for packed sequences), which exist only with TransformerEngine. Without it the
unfused path costs ~6 kernels and two concatenations per call (12.5 ms of `cat` alone in an
H200 step of the Qwen2.5-1.5B shape, docs/gpu-results.md). `install` fills those two slots,
when TransformerEngine has not, with the same math compiled by torch.compile: one kernel
reading the tensor once. Non-interleaved rotary (Llama, Qwen) only; CUDA only.
"""

from __future__ import annotations

import torch

from slime_rl.trainer_megatron.context_parallel import local_positions
from slime_rl.trainer_megatron.device import compiled


def _rope(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Megatron's unfused ``_apply_rotary_pos_emb_bshd`` (mscale 1, not interleaved), op for op."""
    rot = freqs.shape[-1]
    x, rest = t[..., :rot], t[..., rot:]
    cos, sin = freqs.cos().to(t.dtype), freqs.sin().to(t.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x * cos + torch.cat((-x2, x1), dim=-1) * sin, rest), dim=-1)


def rope_bshd(t: torch.Tensor, freqs: torch.Tensor, transpose_output_memory: bool = False,
              interleaved: bool = False) -> torch.Tensor:
    """``t [s, b, heads, dim]``, ``freqs [s, 1, 1, rot]``: TransformerEngine's signature."""
    if interleaved:
        raise ValueError("rotary_interleaved: the compiled RoPE does not do interleaved rotary")
    return compiled(_rope)(t, freqs)


def rope_thd(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor, cp_size: int = 1, cp_rank: int = 0,
             interleaved: bool = False) -> torch.Tensor:
    """Packed ``t [tokens, heads, dim]``: positions restart at every sequence of ``cu_seqlens``. With
    context parallelism ``cu_seqlens`` are the padded full sequences' and ``t`` holds this CP rank's two
    chunks of each (context_parallel.py); every token keeps its position in its own sequence."""
    if interleaved:
        raise ValueError("rotary_interleaved: the compiled RoPE does not do interleaved rotary")
    if cp_size == 1 and freqs.shape[0] == t.shape[0] == int(cu_seqlens[-1]):
        # a table with a row per packed token (mRoPE, vlm.py: positions differ by stream and restart per sequence),
        # which megatron's unfused thd RoPE also takes as it is; a one-sequence RoPE table is the same rows
        return compiled(_rope)(t.unsqueeze(1), freqs).squeeze(1)
    # One call for the whole row, each token with the freqs of its position in its own sequence: a call per
    # sequence cost a few kernels and a compiled-guard check per sequence, per layer, forward and backward
    # (hundreds of short RL samples in a micro-batch). The same values, token for token.
    return compiled(_rope)(t.unsqueeze(1), freqs[_positions(cu_seqlens, t.shape[0], cp_size, cp_rank,
                                                                 freqs.device)]).squeeze(1)


class _LastPositions:
    """The last micro-batch's positions on the device: q and k of every layer, forward and backward, ask for the
    same ones (4 x layers calls a micro-batch), each of which built them on the host and copied them over."""

    key: tuple | None = None
    positions: torch.Tensor | None = None


def _positions(cu_seqlens: torch.Tensor, tokens: int, cp_size: int, cp_rank: int, device: torch.device) -> torch.Tensor:
    """Each token's position in its own sequence, on ``device``. Keyed by the values of ``cu_seqlens`` (a few
    hundred ints on the host; never by the tensor's identity, which a freed and reused buffer could repeat)."""
    cu = cu_seqlens.long()  # on the host (attention.packed_seq_params); anywhere works
    key = (tuple(cu.tolist()), tokens, cp_size, cp_rank, device)
    if _LastPositions.key == key:
        return _LastPositions.positions
    if cp_size != 1:
        positions = local_positions(cu, cp_size, cp_rank)
    else:
        positions = torch.arange(tokens, device=cu.device) - torch.repeat_interleave(cu[:-1], cu.diff())
    if positions.device != device:
        # Pinned and sent without waiting: a blocking host-to-device copy waited on the GPU in every
        # layer's forward (82d8156; docs/trainer-performance.md "bench-moe halving").
        positions = positions.pin_memory().to(device, non_blocking=True)
    _LastPositions.key, _LastPositions.positions = key, positions
    return positions


def install() -> None:
    """Put the compiled RoPE where Megatron looks for TransformerEngine's, unless TransformerEngine's
    kernels are there already."""
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = rope_bshd
        rope_utils.fused_apply_rotary_pos_emb_thd = rope_thd
