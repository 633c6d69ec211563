"""math-verify's verdict, for :class:`~slime_rl.core.rewards.math_answer.MathVerifier`'s worker processes.

Loaded by file path in a worker (:mod:`slime_rl.core.infra.worker_main`), so it imports
math-verify and nothing of slime_rl. It runs in its own process so that the parent
can kill it when sympy hangs (``9^{9^{9^9}}`` never finishes, and no thread can be stopped).
"""

from __future__ import annotations

import logging

import math_verify  # imported when the worker starts: the first answer should not pay for it

logging.getLogger("math_verify").setLevel(logging.ERROR)  # the parent enforces the timeout; its warning is noise


def verify_answer(gold_text: str, pred_text: str) -> bool:
    """math-verify's verdict on ``pred_text`` against ``gold_text``, with its signal-based timeouts off."""
    gold = math_verify.parse(gold_text, parsing_timeout=None)
    pred = math_verify.parse(pred_text, parsing_timeout=None)
    return bool(gold) and bool(pred) and bool(math_verify.verify(gold, pred, timeout_seconds=None))
