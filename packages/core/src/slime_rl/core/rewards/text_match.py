"""Short-answer text rewards: ``exact_match`` and ``f1`` (SQuAD-style normalisation).

The answer is the last ``<answer>...</answer>`` (Search-R1 style), else the
last ``\\boxed{}``, else the whole response. The label is a string (or number)
or a list of acceptable strings; the best match counts.
"""

from __future__ import annotations

import re
import string
from collections import Counter

from slime_rl.core.rewards.math_answer import last_boxed
from slime_rl.core.sample import Sample

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower case, no punctuation, no articles (a/an/the), single spaces."""
    text = _ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION))
    return " ".join(text.split())


def text_answer(response: str) -> str:
    tagged = _ANSWER_TAG.findall(response)
    if tagged:
        return tagged[-1]
    boxed = last_boxed(response)
    return boxed if boxed is not None else response


def label_texts(sample: Sample) -> list[str]:
    label = sample.label
    if label is None:
        raise ValueError(f"sample {sample.index} has no label; text rewards compare against data.label_key")
    labels = label if isinstance(label, list | tuple) else [label]
    if not labels or not all(isinstance(x, str | int | float) for x in labels):
        raise ValueError(f"sample {sample.index}: a text label is a string or a list of strings, got {label!r:.80}")
    return [str(x) for x in labels]


def token_f1(prediction: str, reference: str) -> float:
    """Token-overlap F1 of two normalised strings."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(reference).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


async def exact_match_reward(sample: Sample) -> float:
    """1.0 when the normalised answer equals a normalised label, else 0.0."""
    answer = normalize_answer(text_answer(sample.response))
    return 1.0 if any(answer == normalize_answer(label) for label in label_texts(sample)) else 0.0


async def f1_reward(sample: Sample) -> float:
    """The best token F1 of the answer against the labels, in [0, 1]."""
    answer = text_answer(sample.response)
    return max(token_f1(answer, label) for label in label_texts(sample))
