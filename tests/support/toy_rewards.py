"""User reward functions for the end-to-end tests, loaded by module:attr inside Ray actors."""

from __future__ import annotations

import functools
import os

from slime_rl.core.sample import Sample


@functools.cache
def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.environ["TOY_TOKENIZER"])


async def digit_token_fraction(sample: Sample) -> float:
    """The fraction of sampled tokens whose text holds a digit (a task a random model learns fast)."""
    ids = [t for t, m in zip(sample.response_tokens, sample.loss_mask, strict=True) if m]
    if not ids:
        return 0.0
    pieces = _tokenizer().convert_ids_to_tokens(ids)
    return sum(any(c.isdigit() for c in p) for p in pieces) / len(pieces)


def odd_index(sample: Sample) -> float:
    """1 for every other sample: a group's rewards differ whatever the engine wrote."""
    return float(sample.index % 2)
