"""Fixtures for the CPU tests: a tiny model folder (slime_rl.core.testing: tokenizer trained offline,
config.json, small safetensors) and an interpreter wrapper that runs the stand-in SGLang server
(standin_sglang.py, a test double) where slime-rl would run ``python -m sglang.launch_server``."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest
import torch

from slime_rl.core.testing import tiny_model_folder, train_tokenizer

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
    """An 'interpreter' for cfg.rollout.engine_python: ``<it> -m sglang.launch_server ARGS`` starts the
    stand-in server with the same ARGS, so tests drive the exact launch path the GPU run uses."""
    script = tmp_path_factory.mktemp("standin-bin") / "python"
    script.write_text(
        "#!/bin/sh\n"
        "# TEST DOUBLE: runs the stand-in SGLang server instead of sglang.launch_server\n"
        'if [ "$1" = "-m" ] && [ "$2" = "sglang.launch_server" ]; then\n'
        f'  shift 2; exec "{sys.executable}" "{HERE / "standin_sglang.py"}" "$@"\n'
        "fi\n"
        f'exec "{sys.executable}" "$@"\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return str(script)


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
