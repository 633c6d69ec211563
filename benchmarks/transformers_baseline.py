"""The plain-transformers contender of ``trainer_throughput.py``: one GRPO update (old log-probs, then
forward/backward with the token-level loss, fused AdamW) written with transformers and torch alone.

Two ways to write it, each a class with the same three methods (``groups``, ``log_probs``, ``train_step``):

- ``TransformersBaseline`` (the fixed-length rows: like for like, short, packed, MoE): consecutive
  samples padded into micro-batches of ``micro_batch_size`` and a full fp32 log-softmax of
  ``[b, L, V]`` logits. Fine for equal lengths; on long-tailed lengths it measures padding and the
  logits alone run out of memory.
- ``SortedBudgetBaseline`` (the long-tailed RL mix row, ``--mix``): the best a user would write with
  transformers alone: samples sorted by length and cut into micro-batches of a token budget (padded
  within a micro-batch), the decoder's hidden states only at the response's predicting positions,
  and the LM head + log-softmax over those positions a chunk of tokens at a time, each chunk
  recomputed in backward (``torch.utils.checkpoint``), so no ``[B, L, V]`` fp32 tensor is ever built.

Both: fp32 weights with bf16 autocast (or plain fp32), SDPA attention, right padding with no
attention mask (causal attention keeps padding out of every real token, and SDPA keeps its
``is_causal`` kernel), fused AdamW, gradients clipped to norm 1 like the trainer's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

# fp32 logits per chunk: the budgets the trainer's own fused head uses (trainer_megatron.logprobs),
# so the two heads differ in method, not in chunk size
LOGIT_CHUNK_BYTES = {"cpu": 128 << 20, "cuda": 1 << 30}


def load_model(model_dir: Path, device: str):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="sdpa").to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.99), fused=True)
    return model, opt


def optimizer_step(model, opt) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


class TransformersBaseline:
    """Padded micro-batches of ``micro_batch_size`` consecutive samples (gradients accumulated, the
    loss averaged over all response tokens) and a full fp32 log-softmax of each micro-batch's logits."""

    def __init__(self, model_dir: Path, device: str, autocast: bool, micro_batch_size: int):
        self.device, self.autocast, self.micro_batch_size = device, autocast, micro_batch_size
        self.model, self.opt = load_model(model_dir, device)

    def groups(self, lengths: list[int]) -> list[list[int]]:
        """The rows of each micro-batch."""
        n = len(lengths)
        return [list(range(i, min(i + self.micro_batch_size, n))) for i in range(0, n, self.micro_batch_size)]

    def _micro_batches(self, samples):
        for rows in self.groups([len(s.tokens) for s in samples]):
            yield self._batch([samples[i] for i in rows])

    def _batch(self, samples):
        longest = max(len(s.tokens) for s in samples)
        ids = torch.zeros(len(samples), longest, dtype=torch.long)
        mask = torch.zeros(len(samples), longest - 1)
        adv = torch.zeros(len(samples), longest - 1)
        for j, s in enumerate(samples):
            ids[j, : len(s.tokens)] = torch.tensor(s.tokens)
            start = len(s.tokens) - s.response_length - 1
            mask[j, start : start + s.response_length] = 1
            adv[j, start : start + s.response_length] = s.advantages[0]
        return ids.to(self.device), mask.to(self.device), adv.to(self.device)

    def _token_log_probs(self, ids):
        with torch.autocast(self.device, dtype=torch.bfloat16, enabled=self.autocast):
            logits = self.model(ids).logits
        return torch.log_softmax(logits.float(), -1)[:, :-1].gather(2, ids[:, 1:, None]).squeeze(-1)

    def log_probs(self, samples) -> list[Tensor]:
        """Per micro-batch, ``[b, longest - 1]`` log-probs of each next token."""
        with torch.no_grad():
            return [self._token_log_probs(ids) for ids, _, _ in self._micro_batches(samples)]

    def train_step(self, samples, old: list[Tensor]):
        total = sum(s.response_length for s in samples)
        for (ids, mask, adv), old_mb in zip(self._micro_batches(samples), old, strict=True):
            ratio = torch.exp(self._token_log_probs(ids) - old_mb)
            (-(adv * ratio * mask).sum() / total).backward()
        optimizer_step(self.model, self.opt)


# ---------------------------------------------------------------- sorted, token budget, chunked head


def sorted_budget_groups(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Rows sorted by length, longest first, cut into consecutive micro-batches whose padded size
    (rows x the longest row) fits ``max_tokens``; a row over the budget gets a micro-batch of its own."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


@dataclass
class ResponseMicroBatch:
    ids: Tensor  # [b, longest] right-padded token ids
    predictors: Tensor  # [N] rows of hidden.reshape(-1, h) ([b * longest, h]) that predict a response token
    targets: Tensor  # [N] the response token ids, in ``predictors`` order
    advantages: Tensor  # [N] float32


def response_micro_batch(samples, device: str) -> ResponseMicroBatch:
    longest = max(len(s.tokens) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    for j, s in enumerate(samples):
        ids[j, : len(s.tokens)] = torch.tensor(s.tokens)
    lengths = torch.tensor([len(s.tokens) for s in samples])
    responses = torch.tensor([s.response_length for s in samples])
    columns = torch.arange(longest - 1)
    # position p predicts token p + 1: positions prompt-1 .. length-2 predict the response
    predicts = (columns >= (lengths - responses - 1)[:, None]) & (columns < (lengths - 1)[:, None])
    predictors = (torch.arange(len(samples))[:, None] * longest + columns)[predicts]
    targets = ids[:, 1:][predicts]
    advantages = torch.cat([torch.tensor(s.advantages, dtype=torch.float32) for s in samples])
    return ResponseMicroBatch(ids.to(device), predictors.to(device), targets.to(device),
                              advantages.to(device))


def _chunk_log_probs(hidden: Tensor, targets: Tensor, head: torch.nn.Module) -> Tensor:
    """Log-probs of ``targets`` under ``head(hidden)`` (``[n, h] -> [n]``), the logits in fp32."""
    logits = head(hidden).float()
    return logits.gather(1, targets[:, None]).squeeze(1) - torch.logsumexp(logits, -1)


class SortedBudgetBaseline:
    """Samples sorted by length into micro-batches of ``max_tokens`` padded tokens; the LM head and
    log-softmax only over response positions, ``chunk`` tokens at a time (recomputed in backward)."""

    def __init__(self, model_dir: Path, device: str, autocast: bool, max_tokens: int):
        self.device, self.autocast, self.max_tokens = device, autocast, max_tokens
        self.model, self.opt = load_model(model_dir, device)
        self.head = self.model.get_output_embeddings()
        vocab = self.head.weight.shape[0]
        self.chunk = max(1, LOGIT_CHUNK_BYTES.get(device, LOGIT_CHUNK_BYTES["cpu"]) // (4 * vocab))

    def groups(self, lengths: list[int]) -> list[list[int]]:
        return sorted_budget_groups(lengths, self.max_tokens)

    def _micro_batches(self, samples):
        for rows in self.groups([len(s.tokens) for s in samples]):
            yield response_micro_batch([samples[i] for i in rows], self.device)

    def _response_log_probs(self, mb: ResponseMicroBatch) -> Tensor:
        """``[N]`` log-probs of the micro-batch's response tokens."""
        with torch.autocast(self.device, dtype=torch.bfloat16, enabled=self.autocast):
            hidden = self.model.model(input_ids=mb.ids, use_cache=False).last_hidden_state
            hidden = hidden.reshape(-1, hidden.shape[-1])[mb.predictors]
            parts = []
            for start in range(0, len(mb.targets), self.chunk):
                h, t = hidden[start : start + self.chunk], mb.targets[start : start + self.chunk]
                if torch.is_grad_enabled():  # keep no [chunk, V] logits for backward: recompute them there
                    parts.append(checkpoint(_chunk_log_probs, h, t, self.head, use_reentrant=False))
                else:
                    parts.append(_chunk_log_probs(h, t, self.head))
        return torch.cat(parts)

    def log_probs(self, samples) -> list[Tensor]:
        """Per micro-batch, ``[N]`` log-probs of its response tokens."""
        with torch.no_grad():
            return [self._response_log_probs(mb) for mb in self._micro_batches(samples)]

    def train_step(self, samples, old: list[Tensor]):
        total = sum(s.response_length for s in samples)
        for mb, old_mb in zip(self._micro_batches(samples), old, strict=True):
            ratio = torch.exp(self._response_log_probs(mb) - old_mb)
            (-(mb.advantages * ratio).sum() / total).backward()
        optimizer_step(self.model, self.opt)
