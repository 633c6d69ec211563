"""Backends that do no work, to measure and test the loop's own data path (benchmarks/driver_overhead.py,
tests/e2e/test_loop_data_path.py): an engine that answers at once and a trainer without a model; and engines that
answer from a script, for the multi-turn tests.

Load them by ``module:attr`` like any backend: ``rollout.engine=slime_rl.core.testing.standins:InstantEngine``,
``trainer.backend=slime_rl.core.testing.standins:NoMathTrainer``.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import torch

from slime_rl.core.batch import TRAINER_COLUMNS
from slime_rl.core.contracts import GenerateOutput, NamedTensors, PolicyTrainer, RolloutEngine, SamplingParams
from slime_rl.core.infra.distributed import init_process_group


class InstantEngine(RolloutEngine):
    """Answers each request at once with ``max_new_tokens`` tokens (log-prob -1 each)."""

    def __init__(self):
        self.version = 0

    @classmethod
    def from_config(cls, cfg) -> InstantEngine:
        return cls()

    async def generate(self, input_ids: list[int], params: SamplingParams, request_id: str | None = None):
        n = params.max_new_tokens
        return GenerateOutput([7] * n, [-1.0] * n, "length", self.version)

    async def abort(self, request_id: str | None = None) -> None:
        return None

    async def update_weights(self, named_tensors: NamedTensors, *, version: int, last: bool) -> None:
        if last:
            self.version = version

    @property
    def weight_version(self) -> int:
        return self.version


class FixedWeightsEngine(RolloutEngine):
    """What a scripted test engine has besides its answers: nothing to abort, weight updates ignored, and the
    weight version a constant (``served_version``)."""

    served_version: ClassVar[int] = 0

    async def abort(self, request_id: str | None = None) -> None:
        return None

    async def update_weights(self, named_tensors: NamedTensors, *, version: int, last: bool) -> None:
        return None

    @property
    def weight_version(self) -> int:
        return self.served_version


class ScriptedEngine(FixedWeightsEngine):
    """Answers each request with the next of ``replies`` (its ids, then eos; log-prob -0.5 each) and records each
    request's input ids with the ids it answered (``calls``)."""

    def __init__(self, tokenizer, replies: list[str]):
        self.tokenizer, self.replies = tokenizer, list(replies)
        self.calls: list[tuple[list[int], list[int]]] = []

    async def generate(self, input_ids, params, request_id=None):
        from slime_rl.core.agent.template import encode

        ids = encode(self.tokenizer, self.replies.pop(0)) + [self.tokenizer.eos_token_id]
        self.calls.append((list(input_ids), ids))
        return GenerateOutput(ids, [-0.5] * len(ids), "stop", 0)


class ScriptedImageEngine(ScriptedEngine):
    """A `ScriptedEngine` that takes images and records those each request carried (the multi-turn VLM tests)."""

    accepts_images = True

    def __init__(self, tokenizer, replies: list[str]):
        super().__init__(tokenizer, replies)
        self.images: list = []

    async def generate(self, input_ids, params, request_id=None, images=None):
        self.images.append(images)
        return await super().generate(input_ids, params, request_id)


class NoMathTrainer(PolicyTrainer):
    """A trainer rank without a model: zeros for log-probs, a real gloo group for the DP sums, and
    the shard tensor bytes each rank received, reported by rank 0 for all ranks."""

    def __init__(self):
        import torch.distributed as dist

        if not dist.is_initialized():  # the rendezvous on the address the loop gave (loopback on one node)
            init_process_group("gloo", datetime.timedelta(minutes=5))
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    @classmethod
    def from_config(cls, cfg, *, role="actor") -> NoMathTrainer:
        return cls()

    @property
    def data_parallel_rank(self) -> int:
        return self.rank

    def sum_over_dp(self, tensor: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        out = tensor.clone()
        dist.all_reduce(out)
        return out

    def compute_log_probs(self, batch, *, model="actor") -> torch.Tensor:
        return torch.zeros(batch.num_response_tokens)

    def train_step(self, batch) -> dict[str, float]:
        """Metrics: the optimizer steps and the bytes of rollout columns each rank received (``shard_bytes/<rank>``)."""
        received = torch.zeros(self.world, dtype=torch.float64)
        # what this rank fetched: the shard's columns before the trainer added its own
        received[self.rank] = sum(t.numel() * t.element_size() for name, t in vars(batch).items()
                                  if isinstance(t, torch.Tensor) and name not in TRAINER_COLUMNS)
        received = self.sum_over_dp(received)
        steps = list(batch.optimizer_steps())
        return {"loss": 0.0, "optimizer_steps": float(len(steps)),
                **{f"shard_bytes/{r}": float(b) for r, b in enumerate(received.tolist())}}

    def named_weights(self, bucket_bytes: int) -> Iterator[NamedTensors]:
        yield [("w", torch.zeros(4))]

    def save(self, path: str) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)

    def load(self, path: str) -> None:
        return None
