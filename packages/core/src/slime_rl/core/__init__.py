"""slime-rl core: the types, contracts, config and RL logic shared by every backend.

The names below load on first use: ``import slime_rl.core.sample`` (a reward's worker
process unpickling its samples) must not import torch and pydantic with the contracts.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# First: Ray's environment must be set before anything imports ray (ray_env says why; standard
# library only, so a reward worker still imports neither torch nor pydantic).
from slime_rl.core.infra import ray_env  # noqa: F401  # isort: skip
from slime_rl.core import moved  # isort: skip

moved.install()

if TYPE_CHECKING:
    from slime_rl.core.config import Config, ConfigError, load_config
    from slime_rl.core.contracts import (
        Buffer,
        DataSource,
        GenerateOutput,
        PolicyTrainer,
        RolloutEngine,
        SamplingParams,
    )
    from slime_rl.core.sample import Sample, SampleStatus

__version__ = "0.1.0"
_WHERE = {
    "Config": "config", "ConfigError": "config", "load_config": "config",
    "Buffer": "contracts", "DataSource": "contracts", "GenerateOutput": "contracts", "PolicyTrainer": "contracts",
    "RolloutEngine": "contracts", "SamplingParams": "contracts",
    "Sample": "sample", "SampleStatus": "sample",
}
__all__ = [
    "Buffer", "Config", "ConfigError", "DataSource", "GenerateOutput", "PolicyTrainer", "RolloutEngine",
    "Sample", "SampleStatus", "SamplingParams", "load_config",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'slime_rl.core' has no attribute {name!r}")
    return getattr(importlib.import_module(f"slime_rl.core.{_WHERE[name]}"), name)
