"""Fixtures for the CPU tests: a tiny model folder (tokenizer.json trained offline, config.json,
small safetensors) and an interpreter wrapper that runs the stand-in SGLang server
(standin_sglang.py, a test double) where slime-rl would run ``python -m sglang.launch_server``."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
VOCAB = 300


def make_tiny_model(path: Path) -> Path:
    """tokenizer.json (byte-level BPE trained on a few lines), config.json and small weights."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    lines = ["the quick brown fox jumps over the lazy dog", "what is 1 + 2? the answer is 3",
             "def add(a, b): return a + b", "reinforcement learning from verifiable rewards"] * 20
    tok.train_from_iterator(lines, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}))
    vocab = tok.get_vocab_size()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
        "bos_token_id": tok.token_to_id("<s>"), "eos_token_id": tok.token_to_id("</s>"),
        "tie_word_embeddings": False, "torch_dtype": "bfloat16"}))
    gen = torch.Generator().manual_seed(0)
    weights = {
        "model.embed_tokens.weight": torch.randn(vocab, 8, generator=gen).to(torch.bfloat16),
        "model.norm.weight": torch.ones(8, dtype=torch.bfloat16),
        "lm_head.weight": torch.randn(vocab, 8, generator=gen).to(torch.bfloat16),
    }
    save_file(weights, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"))


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
