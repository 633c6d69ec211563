"""Tiny random HF models with a tokenizer trained offline, for the end-to-end tests."""

from __future__ import annotations

import sys
from pathlib import Path


def train_tokenizer(out_dir: Path, vocab_size: int = 1024):
    """A byte-level BPE trained in about a second on the standard library's sources."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    stdlib = Path(sys.modules["os"].__file__).parent
    texts = [p.read_text(errors="ignore") for p in sorted(stdlib.glob("*.py"))[:60]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(out_dir)
    return fast


def make_tiny_model(out_dir: Path, *, family: str = "qwen2", vocab_size: int = 1024, seed: int = 0,
                    hidden_size: int = 64, num_heads: int = 4, dtype: str = "float32") -> Path:
    """Save a small random model (~0.3M parameters by default) and its tokenizer into ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(out_dir, vocab_size)
    shape = dict(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                 num_hidden_layers=2, num_attention_heads=num_heads, num_key_value_heads=num_heads // 2,
                 max_position_embeddings=2048,
                 eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
                 pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    config = Qwen2Config(**shape) if family == "qwen2" else LlamaConfig(**shape)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(out_dir)
    return out_dir
