"""What a `slime-cli plan` test reads: Qwen2.5-7B's config.json alone (plan estimates from the shape; no weights)
and a one-line prompt file. (A plain module, not conftest: see cli_output.py.)"""

from __future__ import annotations

import json
from pathlib import Path

# Qwen2.5-7B's shape; max_position_embeddings is each test's own
QWEN_7B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
           "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
           "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False}


def qwen_7b_and_prompts(folder: Path, max_position_embeddings: int) -> tuple[Path, Path]:
    """A model folder under ``folder`` holding Qwen2.5-7B's config.json, and a prompt file of one line."""
    model = folder / "qwen7b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**QWEN_7B, "max_position_embeddings": max_position_embeddings}))
    prompts = folder / "prompts.jsonl"
    prompts.write_text('{"input": "1 + 1 =", "label": "2"}\n')
    return model, prompts
