"""Tiny served-role models for tests (no reward-model checkpoint is offline): a random scalar-head
``...ForSequenceClassification`` with one label, sharing a causal model folder's tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch


def tiny_reward_model_folder(out_dir: Path, like: Path, *, seed: int = 0) -> Path:
    """An HF folder of a random ``<Family>ForSequenceClassification`` (``num_labels = 1``) with the config shape
    and tokenizer of the causal model folder ``like``: the kind of model SGLang serves with ``--is-embedding``."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    config = AutoConfig.from_pretrained(like)
    config.num_labels = 1
    config.architectures = None
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(like).save_pretrained(out_dir)
    return out_dir
