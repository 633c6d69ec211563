"""Fixtures for the CPU tests: a tiny model folder (slime_rl.core.testing: tokenizer trained offline,
config.json, small safetensors) and an interpreter wrapper that runs the stand-in SGLang server
(slime_rl.rollout_sglang.testing, a test double) where slime-rl would run ``python -m sglang.launch_server``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from slime_rl.core.testing import tiny_model_folder, train_tokenizer
from slime_rl.rollout_sglang import testing

HERE = Path(__file__).resolve().parent
VOCAB = 300


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A random 1-layer Llama of hidden size 8 in bf16; its BPE (<s>, </s>, <pad>) trained on a few lines."""
    lines = ["the quick brown fox jumps over the lazy dog", "what is 1 + 2? the answer is 3",
             "def add(a, b): return a + b", "reinforcement learning from verifiable rewards"] * 20
    tokenizer = train_tokenizer(lines, vocab_size=VOCAB, special_tokens=["<s>", "</s>", "<pad>"], bos_token="<s>",
                                eos_token="</s>", pad_token="<pad>")
    return tiny_model_folder(tmp_path_factory.mktemp("tiny-model"), "llama", tokenizer=tokenizer, dtype=torch.bfloat16,
                             hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=2)


@pytest.fixture(scope="session")
def standin_python(tmp_path_factory) -> str:
    """An 'interpreter' for cfg.rollout.engine_python that starts the stand-in server (slime_rl.rollout_sglang.testing)."""
    return testing.standin_python(tmp_path_factory.mktemp("standin-bin"))


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
