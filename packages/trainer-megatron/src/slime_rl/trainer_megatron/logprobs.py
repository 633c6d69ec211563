"""Log-probs and entropy of chosen tokens, fused with the (vocab-parallel) output layer.

``hidden [N, h] @ weight[V/tp, h].T`` is computed a chunk of tokens at a time: the
vocab-parallel log-softmax reduces max, sum-exp and the target logit over the TP
group, and the backward pass recomputes each chunk's logits instead of keeping
them. Peak memory is a few ``chunk x V/tp`` fp32 buffers, never ``N x V``
(16k tokens x 151,936 vocab in fp32 would be 9.7 GB).

The rollout temperature is applied as ``logits / temperature``, as the engines do.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

# fp32 logits per chunk (a few such buffers are live at once). The CPU wants them cache-sized;
# a GPU wants long chunks: each chunk's backward adds a [V, h] weight-gradient part in fp32, and
# matmuls over a few hundred rows leave tensor cores idle (1 GiB is ~1,700 tokens of a 151,936 vocab).
CHUNK_BYTES = {"cpu": 128 << 20, "cuda": 1 << 30}


def chunk_tokens(vocab_local: int, chunk_bytes: int | None = None, device_type: str = "cpu") -> int:
    """Tokens per chunk so that one chunk's fp32 logits take about ``chunk_bytes``
    (by default the budget of ``device_type``)."""
    budget = chunk_bytes or CHUNK_BYTES.get(device_type, CHUNK_BYTES["cpu"])
    return max(1, budget // (4 * vocab_local))


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(t, op=op, group=group)
    return t


class _FusedLogProbs(torch.autograd.Function):
    """(hidden, weight) -> log p(target), entropy; chunked forward and recomputing backward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk, group, with_entropy):
        n, v_local = hidden.shape[0], weight.shape[0]
        vocab_start = (dist.get_rank(group) if group is not None else 0) * v_local
        local_t = targets - vocab_start
        in_range = (local_t >= 0) & (local_t < v_local)
        local_t = local_t.clamp(0, v_local - 1)
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else None
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            z = _logits(hidden[s:e], weight, temperature)
            m = _all_reduce(z.max(dim=-1).values, dist.ReduceOp.MAX, group)
            z.sub_(m[:, None])  # shifted logits from here on
            target = torch.where(in_range[s:e], z.gather(1, local_t[s:e, None]).squeeze(1), 0.0)
            if with_entropy:
                p = z.exp()
                # sum_k p_k z_k as a batched dot product (no [chunk, V] temporary)
                stats = [p.sum(-1), target, torch.bmm(p.unsqueeze(1), z.unsqueeze(2)).view(-1)]
            else:
                stats = [z.exp_().sum(-1), target]
            stats = _all_reduce(torch.stack(stats), dist.ReduceOp.SUM, group)
            log_z = stats[0].log()
            lse[s:e] = m + log_z
            logp[s:e] = stats[1] - log_z
            if with_entropy:
                # H = log Z - sum(p z) / Z with shifted logits
                entropy[s:e] = log_z - stats[2] / stats[0]
        ctx.save_for_backward(hidden, weight, local_t, in_range, lse, entropy if with_entropy else lse)
        ctx.temperature, ctx.chunk, ctx.with_entropy = temperature, chunk, with_entropy
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, local_t, in_range, lse, entropy = ctx.saved_tensors
        if not ctx.with_entropy:
            grad_entropy = None
        n, chunk, temperature = hidden.shape[0], ctx.chunk, ctx.temperature
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = None
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            g = grad_logp[s:e, None].float() if grad_logp is not None else None
            # d logp_t / dz_k = 1[k=t] - p_k;   dH / dz_k = -p_k (log p_k + H)
            grad_z = _logits(hidden[s:e], weight, temperature).sub_(lse[s:e, None])  # log p, in place
            if grad_entropy is not None:
                coef = (grad_z + entropy[s:e, None]).mul_(grad_entropy[s:e, None].float())
                if g is not None:
                    coef.add_(g)
                grad_z = grad_z.exp_().mul_(coef).neg_()
            else:
                grad_z = grad_z.exp_().mul_(g).neg_()
            if g is not None:
                grad_z.scatter_add_(1, local_t[s:e, None], torch.where(in_range[s:e, None], g, 0.0))
            if temperature != 1.0:
                grad_z.div_(temperature)
            grad_z = grad_z.to(weight.dtype)
            if grad_hidden is not None:
                grad_hidden[s:e] = grad_z @ weight
            if ctx.needs_input_grad[1]:
                part = grad_z.t() @ hidden[s:e].to(weight.dtype)
                if grad_weight is None:
                    grad_weight = part if chunk >= n else part.float()
                else:  # summed over chunks in fp32
                    grad_weight.add_(part)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def _logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    z = (hidden.to(weight.dtype) @ weight.t()).float()
    if temperature != 1.0:
        z.div_(temperature)
    return z


def token_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets) and (optionally) entropy for each row of ``hidden`` under this TP rank's
    vocab slice ``weight`` (``[V/tp, h]``); both fp32 ``[N]``, identical on all TP ranks."""
    if temperature <= 0:
        raise ValueError(f"rollout.temperature: log-probs need a temperature > 0, got {temperature}")
    tp = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
    if tp > 1:
        # identity forward, all-reduce of the hidden-state gradient backward
        hidden = tensor_parallel.copy_to_tensor_model_parallel_region(hidden)
    chunk = chunk or chunk_tokens(weight.shape[0], device_type=weight.device.type)
    return _FusedLogProbs.apply(hidden, weight, targets, float(temperature), chunk, group, with_entropy)


def full_logits_log_probs(hidden, weight, targets, temperature: float = 1.0):
    """The naive reference (TP=1): full logits, log_softmax, gather. For tests and the memory benchmark."""
    logits = (hidden.to(weight.dtype) @ weight.t()).float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(1, targets[:, None]).squeeze(1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy
