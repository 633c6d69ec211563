"""Tiny random models and a byte-level BPE trained in a blink: no download, 1 torch thread."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

torch.set_num_threads(1)

EOS = "<eos>"
TEXT = [f"Question: What is {a} + {b}?\nAnswer: {a + b}. The sum of {a} and {b} is {a + b}!" for a in range(1, 40)
        for b in range(1, 40, 7)] + ["def forward(self, x):\n    return self.proj(x) + x  # the residual"] * 5


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(TEXT, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS)


@pytest.fixture(scope="session")
def make_model():
    return tiny_model


def tiny_model(arch: str, vocab_size: int, seed: int = 0, eos_token_id: int | None = None):
    """A random causal LM: hidden 64, 2 layers, 4 heads (2 KV); a wide init so the distributions are peaked, not uniform."""
    torch.manual_seed(seed)
    shape = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                 initializer_range=0.2, eos_token_id=eos_token_id, bos_token_id=None, pad_token_id=None,
                 tie_word_embeddings=False)
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**shape)).float().eval()
    return Qwen2ForCausalLM(Qwen2Config(**shape)).float().eval()
