"""Shared helpers: prompt files and a word-level tokenizer with a chat template, built in memory."""

from __future__ import annotations

import pytest
import torch

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
