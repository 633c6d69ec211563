"""Rewards that fail in the ways a user's reward does, for the end-to-end failure tests (loaded by
module:attr in the rollout's reward workers). Three samples in eight hang or block; the rest score."""

from __future__ import annotations

import time

from slime_rl.core.sample import Sample


def _hangs(sample: Sample) -> bool:
    return sample.index % 8 < 3


async def blocks_event_loop(sample: Sample) -> float:
    """An async reward with a blocking call in it (as with ``time.sleep`` or ``requests``)."""
    if _hangs(sample):
        time.sleep(3600)
    return 1.0


def hangs(sample: Sample) -> float:
    """A plain reward that never returns for some samples."""
    if _hangs(sample):
        time.sleep(3600)
    return 1.0


def always_raises(sample: Sample) -> float:
    raise ConnectionError("judge server at http://judge:8000 refused the connection")
