"""Tiny random models and a byte-level BPE trained in a blink (slime_rl.core.testing): no download, 1 torch thread."""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from slime_rl.core.testing import tiny_config, tiny_model, train_tokenizer

torch.set_num_threads(1)

EOS = "<eos>"
TEXT = [f"Question: What is {a} + {b}?\nAnswer: {a + b}. The sum of {a} and {b} is {a + b}!" for a in range(1, 40)
        for b in range(1, 40, 7)] + ["def forward(self, x):\n    return self.proj(x) + x  # the residual"] * 5


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return train_tokenizer(TEXT, vocab_size=384, special_tokens=[EOS])


@pytest.fixture(scope="session")
def make_model():
    return random_model


def random_model(arch: str, vocab_size: int, seed: int = 0, eos_token_id: int | None = None) -> PreTrainedModel:
    """A random causal LM: hidden 64, 2 layers, 4 heads (2 KV); a wide init so the distributions are peaked,
    not uniform."""
    config = tiny_config(arch, vocab_size=vocab_size, max_position_embeddings=4096, initializer_range=0.2,
                         eos_token_id=eos_token_id, bos_token_id=None, pad_token_id=None)
    return tiny_model(config, seed=seed)
