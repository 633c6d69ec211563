"""slime-rl core: the types, contracts, config and RL logic shared by every backend."""

# First: Ray's environment must be set before anything imports ray (ray_env says why).
from slime_rl.core import ray_env  # noqa: F401  # isort: skip
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
__all__ = [
    "Buffer", "Config", "ConfigError", "DataSource", "GenerateOutput", "PolicyTrainer", "RolloutEngine",
    "Sample", "SampleStatus", "SamplingParams", "load_config",
]
