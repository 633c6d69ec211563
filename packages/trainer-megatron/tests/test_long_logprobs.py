"""The chunked log-prob head (trainer_megatron/logprobs.py) at 32k and 64k response tokens, with the
entropy and the loss the trainer builds on it (PPO surrogate, KL to the reference, entropy bonus; one
sample of the whole length and a shorter one beside it): the loss and the gradients of the hidden
states and the output layer equal a float64 full-logits reference, and no tensor of the forward or
the backward ever holds more than one chunk of logits. A small vocabulary keeps it seconds; the
memory at a real vocabulary is benchmarks/long_logprobs_memory.py's table (docs/long-context.md)."""

from __future__ import annotations

import pytest
import torch
from megatron_testlib import megatron_on_cpu_single_rank

from slime_rl.core.algorithms.losses import LossBatch, compute_loss, pad_sequences
from slime_rl.core.config import AlgorithmConfig
from slime_rl.trainer_megatron import logprobs

HIDDEN, VOCAB = 16, 512
CHUNK_BYTES = 1 << 20  # 512 tokens of this vocabulary a chunk: 64 and 128 chunks
ALGO = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01, eps_clip=0.2)


@pytest.fixture(scope="module", autouse=True)
def megatron_single_rank():
    megatron_on_cpu_single_rank()


def full_logits_float64(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor):
    """The naive head in float64: every logit at once, log_softmax, gather; the entropy from the same."""
    logp_all = torch.log_softmax(hidden.double() @ weight.double().t(), dim=-1)
    return logp_all.gather(1, targets[:, None]).squeeze(1), -(logp_all.exp() * logp_all).sum(-1)


def loss_of(logp: torch.Tensor, entropy: torch.Tensor, lengths: list[int], fixed: dict) -> torch.Tensor:
    """The trainer's loss over the packed tokens, per sample padded as the trainer pads them."""
    def rows(flat):
        return pad_sequences(list(flat.split(lengths)))

    batch = LossBatch(log_probs=rows(logp), old_log_probs=rows(fixed["old"].to(logp.dtype)),
                      advantages=rows(fixed["adv"].to(logp.dtype)), loss_mask=rows(fixed["mask"].to(logp.dtype)),
                      ref_log_probs=rows(fixed["ref"].to(logp.dtype)), entropy=rows(entropy))
    num_tokens = float(fixed["mask"].sum())
    loss, _ = compute_loss(ALGO, batch, eps_clip_high=0.2, num_tokens=num_tokens, num_seqs=len(lengths))
    return loss


@pytest.mark.parametrize("tokens", [32768, 65536])
def test_the_chunked_head_with_entropy_and_loss_equals_full_logits_in_float64(tokens, monkeypatch):
    g = torch.Generator().manual_seed(tokens)
    lengths = [tokens - 1000, 1000]
    hidden = torch.randn(tokens, HIDDEN, generator=g)
    weight = torch.randn(VOCAB, HIDDEN, generator=g) * 0.3
    targets = torch.randint(0, VOCAB, (tokens,), generator=g)
    with torch.no_grad():
        base, _ = full_logits_float64(hidden, weight, targets)
    fixed = {"old": (base + 0.05 * torch.randn(tokens, generator=g, dtype=torch.float64)).float(),
             "ref": (base + 0.05 * torch.randn(tokens, generator=g, dtype=torch.float64)).float(),
             "adv": torch.randn(tokens, generator=g), "mask": (torch.rand(tokens, generator=g) > 0.1).float()}

    widest = []
    real_logits = logprobs._logits
    monkeypatch.setattr(logprobs, "_logits", lambda h, w: widest.append(h.shape[0]) or real_logits(h, w))
    chunk = logprobs.chunk_tokens(VOCAB, CHUNK_BYTES)
    h32, w32 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, entropy = logprobs.token_log_probs(h32, w32, targets, with_entropy=True, chunk=chunk)
    loss = loss_of(logp, entropy, lengths, fixed)
    loss.backward()
    assert chunk == 512 and max(widest) == chunk and len(widest) == 2 * tokens // chunk  # forward and backward

    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref_logp, ref_entropy = full_logits_float64(h64, w64, targets)
    ref_loss = loss_of(ref_logp, ref_entropy, lengths, fixed)
    ref_loss.backward()

    assert torch.allclose(logp.double(), ref_logp, atol=2e-5, rtol=0)
    assert torch.allclose(entropy.double(), ref_entropy, atol=2e-5, rtol=0)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * max(1.0, abs(ref_loss.item()))
    for got, want in ((h32.grad, h64.grad), (w32.grad, w64.grad)):
        scale = want.abs().max().item()
        assert (got.double() - want).abs().max().item() <= 1e-4 * scale, (got - want.float()).abs().max()
