"""On-policy distillation's teacher side: its log-probs of the student's sampled tokens (a prefill, nothing
generated), and the check that teacher and student share one tokenizer. The estimator is
algorithms/advantages.py's ``opd``; docs/distillation.md."""

from __future__ import annotations

import asyncio
import math
from typing import Any

from slime_rl.core.config.errors import ConfigError
from slime_rl.core.roles.client import RoleClient
from slime_rl.core.sample import Sample


def tokenizer_mismatch(student: Any, teacher: Any) -> str | None:
    """Why ``teacher`` cannot score ``student``'s token ids (vocabularies or special tokens differ), or None."""
    mine, theirs = student.get_vocab(), teacher.get_vocab()
    if mine != theirs:
        differ = sorted(t for t in set(mine) | set(theirs) if mine.get(t) != theirs.get(t))
        shown = ", ".join(f"{t!r}: {mine.get(t)} vs {theirs.get(t)}" for t in differ[:3])
        return (f"the vocabularies differ in {len(differ)} tokens ({shown}; student's id vs teacher's) of"
                f" {len(mine)} and {len(theirs)}")
    for what in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(student, what, None) != getattr(teacher, what, None):
            return f"{what} is {getattr(student, what, None)} for the student, {getattr(teacher, what, None)} for the teacher"
    return None


def check_same_tokenizer(student: Any, teacher: Any, role: str) -> None:
    if reason := tokenizer_mismatch(student, teacher):
        raise ConfigError(f"roles.{role}.path", f"the teacher cannot score the student's tokens: {reason}; the"
                          " teacher reads the student's token ids as they are, so both need one tokenizer (a teacher"
                          " of the same family, or roles.<name>.tokenizer_path if only the files differ)")


async def teacher_log_probs(client: RoleClient, samples: list[Sample], batch_size: int) -> list[list[float]]:
    """The teacher's log-prob of every response token of each sample, given the tokens before it;
    ``batch_size`` sequences a request, the requests in flight together."""
    chunks = [samples[i:i + batch_size] for i in range(0, len(samples), batch_size)]
    parts = await asyncio.gather(*(client.prefill_log_probs([list(s.tokens) for s in chunk],
                                                            [s.response_length for s in chunk]) for chunk in chunks))
    return [row for part in parts for row in part]


def reverse_kl_metrics(samples: list[Sample], teacher: list[list[float]]) -> dict[str, float]:
    """The student's reverse KL to the teacher, ``KL(pi_S || pi_T)``, estimated on its own sampled (trained)
    tokens as ``mean(log pi_S - log pi_T)`` (k1), and per sequence (the sum over its tokens, averaged)."""
    token_sum, tokens, seq_sums = 0.0, 0, []
    for sample, row in zip(samples, teacher, strict=True):
        mask = sample.loss_mask or [1] * sample.response_length
        diffs = [s - t for s, t, m in zip(sample.rollout_log_probs, row, mask, strict=True) if m]
        token_sum += sum(diffs)
        tokens += len(diffs)
        seq_sums.append(sum(diffs))
    per_token = token_sum / tokens if tokens else math.nan
    return {"opd/reverse_kl": per_token, "opd/reverse_kl_per_seq": sum(seq_sums) / max(len(seq_sums), 1),
            "opd/teacher_tokens": float(tokens)}


class TeacherScorer:
    """The rollout worker's teacher: scores a step's samples before they become the trainer's batch (sync and
    fully async alike: both hand their samples to the worker the same way)."""

    def __init__(self, name: str, batch_size: int):
        self.name, self.batch_size = name, batch_size

    @classmethod
    def from_config(cls, cfg: Any, student_tokenizer: Any) -> TeacherScorer | None:
        """None unless the estimator needs a teacher; refuses a teacher whose tokenizer is not the student's."""
        from transformers import AutoTokenizer

        from slime_rl.core.algorithms.registry import advantage_estimator_of
        from slime_rl.core.config.roles import the_role

        if not advantage_estimator_of(cfg.algorithm).needs_teacher:
            return None
        name = the_role(cfg.roles, "teacher", f"algorithm.advantage_estimator={cfg.algorithm.advantage_estimator}")
        role = cfg.roles[name]
        check_same_tokenizer(student_tokenizer, AutoTokenizer.from_pretrained(role.tokenizer_path or role.path), name)
        return cls(name, role.batch_size)

    async def score(self, samples: list[Sample], metrics: dict[str, float]) -> list[list[float]]:
        """The teacher's log-probs of ``samples``; adds the reverse-KL and prefill-time metrics to ``metrics``."""
        import time

        from slime_rl.core.roles.endpoints import read_endpoints

        started = time.perf_counter()
        rows = await teacher_log_probs(read_endpoints()[self.name].client(), samples, self.batch_size)
        metrics["time/teacher_prefill"] = time.perf_counter() - started
        metrics.update(reverse_kl_metrics(samples, rows))
        return rows
