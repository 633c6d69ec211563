"""Math answer rewards: ``math``, ``dapo`` and ``deepscaler``.

Answers are extracted here (the last ``\\boxed{}``, an ``Answer:`` line, ...)
and checked for mathematical equivalence with math-verify, which runs in
worker processes (:class:`MathVerifier`): off the event loop, and killed when
sympy hangs on a pathological answer. An answer math-verify cannot settle
within ``VERIFY_TIMEOUT_S`` counts as wrong.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import threading
from pathlib import Path

from slime_rl.core.infra.workers import (
    UserCodeError,
    UserCodeLoadError,
    UserCodeTimeout,
    WorkerPool,
    WorkerStartError,
)
from slime_rl.core.sample import Sample

logger = logging.getLogger(__name__)

VERIFY_TIMEOUT_S = 10.0  # per answer, inside the worker
MAX_ANSWER_CHARS = 1000  # longer "answers" are not answers; they are not sent to sympy
MAX_TAIL_CHARS = 2000  # without a marked answer, math-verify searches this much of the response's end
_WORKER_DIR = str(Path(__file__).parent)
_VERIFY = "math_worker:verify_answer"


# ---------------------------------------------------------------- extraction


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed 5``), braces balanced."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    if text[i : i + 1] == " ":  # "\boxed 5": one token, up to whitespace or "$"
        tokens = text[i:].split("$")[0].split()
        return tokens[0] if tokens else None
    if text[i : i + 1] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j].strip()
    return None  # unbalanced: the response was cut off inside the box


_ANSWER_LINE = re.compile(r"(?:final answer|answer)\s*(?:is|:)\s*:?\s*(.+)", re.IGNORECASE)


def math_answer_text(response: str) -> str | None:
    """What to hand math-verify for ``response``: the last box, else the last "answer is"/"Answer:"
    line, else the end of the response (math-verify finds the last expression there)."""
    boxed = last_boxed(response)
    if boxed is not None:
        return f"\\boxed{{{boxed}}}" if len(boxed) <= MAX_ANSWER_CHARS else None
    lines = _ANSWER_LINE.findall(response)
    if lines:
        answer = lines[-1].strip().rstrip(".").strip()
        return answer if 0 < len(answer) <= MAX_ANSWER_CHARS else None
    return response[-MAX_TAIL_CHARS:] if response.strip() else None


def dapo_answer_text(response: str) -> str | None:
    """DAPO's format: the last ``Answer: ...`` line (its prompt asks for ``Answer: $Answer``)."""
    found = re.findall(r"Answer:\s*(.+)", response)
    if not found:
        return None
    answer = found[-1].strip().rstrip(".").strip().strip("$").strip()
    return answer if 0 < len(answer) <= MAX_ANSWER_CHARS else None


def label_text(sample: Sample) -> str:
    """The gold answer as math-verify input (bare answers are read as LaTeX math)."""
    label = sample.label
    if label is None:
        raise ValueError(f"sample {sample.index} has no label; math rewards compare against data.label_key")
    if isinstance(label, bool) or not isinstance(label, str | int | float):
        raise ValueError(f"sample {sample.index}: a math label is a string or number, got {type(label).__name__}")
    text = str(label).strip()
    return text if ("$" in text or "\\boxed" in text) else f"${text}$"


# ---------------------------------------------------------------- math-verify in killable workers


class MathVerifier:
    """math-verify in a small pool of worker processes; :meth:`verify` blocks (call it from a thread).

    A worker that takes longer than ``timeout_s`` on one answer is killed and
    replaced, and the answer counts as not verified."""

    def __init__(self, num_workers: int, timeout_s: float = VERIFY_TIMEOUT_S):
        self.timeout_s = timeout_s
        # math_worker.py is loaded by file path: importing the package would pull in pydantic and httpx.
        self._pool = WorkerPool(num_workers, path=[_WORKER_DIR], preload=["math_worker"], quiet=True,
                                name="math-verify")

    async def averify(self, gold: str, pred: str) -> bool:
        return await self._pool.run(self.verify, gold, pred)

    def verify(self, gold: str, pred: str) -> bool:
        try:
            return bool(self._pool.call(_VERIFY, (gold, pred), self.timeout_s))
        except UserCodeTimeout:
            logger.warning("math-verify gave up after %.0f s on answer %.80r; scored as wrong", self.timeout_s, pred)
            return False
        except (UserCodeLoadError, WorkerStartError) as err:
            raise RuntimeError(f"math-verify does not load in a worker process ({err}); "
                               "is math-verify installed in this environment?") from None
        except UserCodeError as err:
            if getattr(err, "worker_lost", False):
                raise RuntimeError(f"math-verify worker died: {err}") from None
            logger.debug("math-verify failed on %.80r: %s", pred, err)  # a bad expression is a wrong answer
            return False

    def close(self) -> None:
        self._pool.close()


_verifier: MathVerifier | None = None
_verifier_lock = threading.Lock()


def verifier() -> MathVerifier:
    """The process-wide pool: SLIME_RL_MATH_WORKERS processes (default: half the cores, 1 to 8)."""
    global _verifier
    with _verifier_lock:
        if _verifier is None:
            default = min(8, max(1, (os.cpu_count() or 2) // 2))
            _verifier = MathVerifier(int(os.environ.get("SLIME_RL_MATH_WORKERS", default)))
            atexit.register(_verifier.close)
        return _verifier


async def is_equivalent(gold: str, pred: str) -> bool:
    return await verifier().averify(gold, pred)


# ---------------------------------------------------------------- the rewards


async def math_reward(sample: Sample) -> float:
    """1.0 when the final answer (last \\boxed{}, else an "answer is" line, else the last expression)
    equals the label by math-verify, else 0.0."""
    gold = label_text(sample)
    pred = math_answer_text(sample.response)
    return 1.0 if pred is not None and await is_equivalent(gold, pred) else 0.0


async def dapo_reward(sample: Sample) -> float:
    """DAPO: 1.0 for a correct final ``Answer: ...`` line, -1.0 for a wrong or missing one."""
    gold = label_text(sample)
    pred = dapo_answer_text(sample.response)
    return 1.0 if pred is not None and await is_equivalent(gold, f"${pred}$") else -1.0


async def deepscaler_reward(sample: Sample) -> float:
    """DeepScaleR: 1.0 when the reasoning is closed (``</think>``) and the \\boxed{} answer after it
    is correct, else 0.0."""
    gold = label_text(sample)
    if "</think>" not in sample.response:
        return 0.0
    boxed = last_boxed(sample.response.rsplit("</think>", 1)[1])
    if boxed is None or len(boxed) > MAX_ANSWER_CHARS:
        return 0.0
    return 1.0 if await is_equivalent(gold, f"\\boxed{{{boxed}}}") else 0.0
