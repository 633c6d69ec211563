"""The fused, chunked log-prob/entropy head equals a plain full-logits log_softmax in value and gradient."""

from __future__ import annotations

import pytest
import torch
from megatron_testlib import megatron_on_cpu_single_rank

from slime_rl.trainer_megatron import logprobs


@pytest.fixture(scope="module", autouse=True)
def megatron_single_rank():
    megatron_on_cpu_single_rank()


@pytest.mark.parametrize("chunk", [1, 7, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_full_logits_in_value_and_gradient(chunk, temperature):
    g = torch.Generator().manual_seed(0)
    n, h, v = 23, 16, 50
    hidden = torch.randn(n, h, generator=g, dtype=torch.float32).requires_grad_()
    weight = torch.randn(v, h, generator=g, dtype=torch.float32).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    w_lp, w_ent = torch.randn(n, generator=g, dtype=torch.float32), torch.randn(n, generator=g, dtype=torch.float32)

    logp, entropy = logprobs.token_log_probs(hidden, weight, targets, temperature=temperature, with_entropy=True,
                                             chunk=chunk)
    (logp * w_lp + entropy * w_ent).sum().backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    ref_logp, ref_ent = logprobs.full_logits_log_probs(hidden, weight, targets, temperature)
    (ref_logp * w_lp + ref_ent * w_ent).sum().backward()

    assert torch.allclose(logp, ref_logp, atol=1e-5)
    assert torch.allclose(entropy, ref_ent, atol=1e-5)
    assert torch.allclose(grads[0], hidden.grad, atol=1e-5, rtol=1e-5)
    assert torch.allclose(grads[1], weight.grad, atol=1e-5, rtol=1e-5)


def test_entropy_unused_costs_no_gradient_and_log_probs_alone_match():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(9, 8, generator=g).requires_grad_()
    weight = torch.randn(30, 8, generator=g).requires_grad_()
    targets = torch.randint(0, 30, (9,), generator=g)
    logp, entropy = logprobs.token_log_probs(hidden, weight, targets, with_entropy=False, chunk=4)
    assert entropy is None
    logp.sum().backward()
    ref, _ = logprobs.full_logits_log_probs(hidden.detach().requires_grad_(), weight, targets)
    assert torch.allclose(logp, ref, atol=1e-6)
    assert hidden.grad is not None and torch.isfinite(hidden.grad).all()


def test_zero_temperature_is_refused():
    with pytest.raises(ValueError, match="temperature"):
        logprobs.token_log_probs(torch.zeros(1, 2), torch.zeros(3, 2), torch.zeros(1, dtype=torch.long),
                                 temperature=0.0)


def test_chunk_size_bounds_the_logits_buffer():
    # 151,936-token vocabulary: one chunk's fp32 logits stay within the budget, far below N x V
    for device_type in ("cpu", "cuda"):
        tokens = logprobs.chunk_tokens(151936, device_type=device_type)
        assert tokens * 151936 * 4 <= logprobs.CHUNK_BYTES[device_type]
        assert tokens < 16384 // 8  # 16k tokens come in many chunks on either device


@pytest.mark.slow  # torch.compile of the chunk kernels: ~16 s on 2 cores
def test_per_chunk_kernels_compile_to_the_same_values():
    """On CUDA the three per-chunk passes run through torch.compile (inductor); compiled here on
    the CPU they must give what the eager functions give, for two chunk shapes (dynamic shapes)."""
    g = torch.Generator().manual_seed(2)
    for rows in (5, 3):
        v = 40
        z = torch.randn(rows, v, generator=g).to(torch.bfloat16)
        local_t = torch.randint(0, v, (rows,), generator=g)
        in_range = torch.tensor([True, False, True, True, False][:rows])
        m, target = logprobs._max_and_target(z, local_t, in_range, 0.7)
        sums = logprobs._exp_sums(z, m, 0.7, True)
        lse, entropy = m + sums[0].log(), torch.rand(rows, generator=g)
        grad_args = (z, lse, local_t, in_range, torch.randn(rows, generator=g), entropy, torch.randn(rows, generator=g))
        for fn, args in ((logprobs._max_and_target, (z, local_t, in_range, 0.7)),
                         (logprobs._exp_sums, (z, m, 0.7, True)),
                         (logprobs._logit_grad, (*grad_args, 0.7)),
                         (logprobs._logit_grad, (*grad_args[:6], None, 0.7))):
            eager = fn(*args)
            compiled = torch.compile(fn, dynamic=True)(*args)
            for a, b in zip(eager if isinstance(eager, tuple) else (eager,),
                            compiled if isinstance(compiled, tuple) else (compiled,), strict=True):
                assert a.dtype == b.dtype
                assert torch.allclose(a.float(), b.float(), atol=1e-2 if a.dtype == torch.bfloat16 else 1e-5)
