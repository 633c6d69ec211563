"""Log-probs and entropy of chosen tokens, fused with the (vocab-parallel) output layer.

``hidden [N, h] @ weight[V/tp, h].T`` is computed a chunk of tokens at a time: the
vocab-parallel log-softmax reduces max, sum-exp and the target logit over the TP
group, and the backward pass recomputes each chunk's logits instead of keeping
them. Peak memory is a few ``chunk x V/tp`` buffers, never ``N x V`` (16k tokens x
151,936 vocab in fp32 would be 9.7 GB).

The rollout temperature is applied as ``logits / temperature``, as the engines do.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from slime_rl.trainer_megatron.device import compiled

# Logits per chunk, counted as fp32 (the budget a chunk may take). The CPU wants chunks
# cache-sized; a GPU wants long ones: each chunk's backward adds a [V, h] weight-gradient part
# in fp32, and matmuls over a few hundred rows leave tensor cores idle (1 GiB is ~1,700 tokens
# of a 151,936 vocab).
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


# ---------------------------------------------------------------- per-chunk math
# Three passes over a chunk's logits ``z`` ([c, V/tp], the matmul's dtype), each a pure
# function: on CUDA torch.compile fuses each into one kernel that reads z once and keeps the
# fp32 math in registers (eager, they would be ~10 passes over fp32 temporaries). The max has
# to be reduced over TP before the exponentials, hence two forward passes.


def _max_and_target(z, local_t, in_range, temperature: float):
    """Row max of z / T, and the target's z / T (0 where the target lies on another TP rank)."""
    zf = z.float() / temperature
    target = zf.gather(1, local_t[:, None]).squeeze(1)
    return zf.amax(dim=-1), torch.where(in_range, target, 0.0)


def _exp_sums(z, m, temperature: float, with_entropy: bool):
    """sum_k exp(z_k/T - m) and, for the entropy, sum_k exp(z_k/T - m) * (z_k/T - m)."""
    # In-place steps on fresh temporaries only: eager (CPU) they keep two [c, V] buffers live
    # at most; compiled, they fuse all the same.
    shifted = z.float() / temperature
    shifted.sub_(m[:, None])
    if not with_entropy:
        return shifted.exp_().sum(-1), None
    p = shifted.exp()
    sum_p = p.sum(-1)
    return sum_p, p.mul_(shifted).sum(-1)


def _logit_grad(z, lse, local_t, in_range, grad_logp, entropy, grad_entropy, temperature: float):
    """d(loss)/dz for one chunk, in z's dtype: d logp_t/dz_k = (1[k=t] - p_k) / T and
    dH/dz_k = -p_k (log p_k + H) / T."""
    logp = z.float() / temperature
    logp.sub_(lse[:, None])
    grad = logp.exp()  # p
    if grad_entropy is None:
        grad.mul_(grad_logp[:, None].neg())
    else:  # -p * (g + (log p + H) * gH), reusing logp's buffer for the bracket
        coef = logp.add_(entropy[:, None]).mul_(grad_entropy[:, None]).add_(grad_logp[:, None])
        grad.mul_(coef).neg_()
    grad.scatter_add_(1, local_t[:, None], torch.where(in_range, grad_logp, 0.0)[:, None])
    return grad.div_(temperature).to(z.dtype)


def _kernel(fn, z: torch.Tensor):
    """``fn`` itself on the CPU; compiled on CUDA."""
    return compiled(fn) if z.device.type == "cuda" else fn


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
        max_and_target, exp_sums = _kernel(_max_and_target, hidden), _kernel(_exp_sums, hidden)
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            z = _logits(hidden[s:e], weight)
            m, target = max_and_target(z, local_t[s:e], in_range[s:e], temperature)
            m = _all_reduce(m, dist.ReduceOp.MAX, group)
            sum_p, sum_pz = exp_sums(z, m, temperature, with_entropy)
            stats = [sum_p, target] + ([sum_pz] if with_entropy else [])
            stats = _all_reduce(torch.stack(stats), dist.ReduceOp.SUM, group)
            log_z = stats[0].log()
            lse[s:e] = m + log_z
            logp[s:e] = stats[1] - lse[s:e]
            if with_entropy:
                # H = log Z - sum(p z') / Z with shifted logits z' = z/T - m
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
        n, chunk = hidden.shape[0], ctx.chunk
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        logit_grad = _kernel(_logit_grad, hidden)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = None
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            grad_z = logit_grad(_logits(hidden[s:e], weight), lse[s:e], local_t[s:e], in_range[s:e],
                                grad_logp[s:e].float(), entropy[s:e],
                                grad_entropy[s:e].float() if grad_entropy is not None else None, ctx.temperature)
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


def _logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One chunk's logits in the weights' dtype (the per-chunk kernels upcast as they read)."""
    return hidden.to(weight.dtype) @ weight.t()


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
