"""Stand-in engine and trainer that append each memory hand-over and weight sync to the file named by
SLIME_MEMORY_ORDER_LOG (both run in their own Ray actors), for tests/e2e/test_loop_data_path.py."""

from __future__ import annotations

import os

from slime_rl.core.testing.standins import InstantEngine, NoMathTrainer


def record(event: str) -> None:
    with open(os.environ["SLIME_MEMORY_ORDER_LOG"], "a") as log:
        log.write(event + "\n")


class RecordingEngine(InstantEngine):
    async def release_memory(self) -> None:
        record("engine release")

    async def resume_memory(self, tags: list[str] | None = None) -> None:
        record(f"engine resume {','.join(tags) if tags else 'all'}")

    async def update_weights(self, named_tensors, *, version: int, last: bool) -> None:
        record("engine weights")
        await super().update_weights(named_tensors, version=version, last=last)


class RecordingTrainer(NoMathTrainer):
    def offload(self) -> None:
        record("trainer offload")

    def onload(self) -> None:
        record("trainer onload")

    def train_step(self, batch) -> dict[str, float]:
        record("trainer train")
        return super().train_step(batch)
