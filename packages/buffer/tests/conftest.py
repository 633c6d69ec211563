"""Shared helpers: prompt files and a word-level tokenizer with a chat template, built in memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from slime_rl.core.sample import Sample, SampleStatus

torch.set_num_threads(1)

WORDS = ["[UNK]", "<|user|>", "<|assistant|>", "<|system|>", "<|tools|>", "what", "is", "+", "?", "be", "brief",
         "hello", "world"] + [str(i) for i in range(100)]
CHAT_TEMPLATE = ("{% if tools %}<|tools|> {{ tools|length }} {% endif %}"
                 "{% for m in messages %}<|{{ m.role }}|> {{ m.content }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="session")
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    hf.chat_template = CHAT_TEMPLATE
    return hf


def write_jsonl(path: Path, rows: list) -> Path:
    """Rows are dicts (written as JSON) or raw strings (written as they are)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def arithmetic_rows(n: int) -> list[dict]:
    return [{"input": f"what is {i} + {i % 7} ?", "label": str(i + i % 7), "metadata": {"row": i}} for i in range(n)]


def finished_group(group_index: int, n: int = 4, *, version: int = 0, rewards: list | None = None,
                   prompt_len: int = 3, response_len: int = 2) -> list[Sample]:
    rewards = rewards if rewards is not None else [float(k % 2) for k in range(n)]
    out = []
    for k in range(n):
        s = Sample(index=group_index * n + k, group_index=group_index, prompt=f"p{group_index}",
                   label=str(group_index), tokens=list(range(prompt_len)), weight_version=version,
                   metadata={"k": k})
        s.append_response([100 + k] * response_len, [-0.5 - k] * response_len, trained=True)
        s.reward, s.status, s.response = rewards[k], SampleStatus.COMPLETED, "ok"
        out.append(s)
    return out
