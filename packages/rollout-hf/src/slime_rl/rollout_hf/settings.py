"""``rollout.hf``: the transformers engine's own config keys, checked when the config loads.

Light on purpose (pydantic only): the config loader finds this model through the entry point
``slime_rl.rollout_engines.settings`` without importing the engine (torch, transformers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from slime_rl.core.config import SEED_MAX, BackendSettings

if TYPE_CHECKING:
    from slime_rl.core.config import Config


class HFSettings(BackendSettings):
    """The in-process transformers engine (CPU or one GPU); these were `rollout.engine_args` keys."""

    max_batch_size: int | None = Field(None, ge=1, description=(
        "requests decoded together in one batch; `null`: `rollout.max_concurrency`"))
    seed: int | None = Field(None, ge=0, le=SEED_MAX, description=(
        "seeds the sampling of requests that bring no seed of their own; `null`: `trainer.seed`"))
    gather_window_s: float = Field(0.002, ge=0.0, description=(
        "after a wave's first request, seconds to wait for the rest before the batch starts"))
    num_threads: int | None = Field(None, ge=1, description=(
        "torch threads for generation; `null`: the process's setting"))


def hf_settings(cfg: Config) -> HFSettings:
    """The run's ``rollout.hf`` (its defaults when the config gives none)."""
    return cfg.rollout.settings_of(HFSettings, "hf")
