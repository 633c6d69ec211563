"""The config: YAML in, dotted ``key=value`` overrides, checked before anything starts. Import it from here.

Three modules hold it, one idea each:
- config_schema.py: the tree (sections, fields, defaults, derived values) and ConfigError;
- config_loader.py: reading YAML and overrides into the tree (`load_config`);
- config_checks.py: the cross-field checks `load_config` runs (`check_config`), placement's among them;
- backends.py: each backend's typed section (``rollout.sglang``), checked against the model it declares;
- renamed.py: old key names, which still load for a release with a notice;
- errors.py: `ConfigError` and the one-line messages of unknown keys and refused values.

The modules the checks import (placement) import config_schema, not this module: this one imports
the checks, so that would be a cycle.
"""

from slime_rl.core.config.backends import BackendSettings, NoSettings
from slime_rl.core.config.checks import check_config, check_model, read_model_shape
from slime_rl.core.config.loader import (
    MAX_CONFIG_BYTES,
    MAX_YAML_DEPTH,
    MAX_YAML_VALUES,
    load_config,
    parse_overrides,
    parse_yaml,
)
from slime_rl.core.config.renamed import RenamedKeyWarning
from slime_rl.core.config.schema import (
    SEED_MAX,
    AlgorithmConfig,
    CheckpointConfig,
    CheckpointError,
    ClusterConfig,
    Config,
    ConfigError,
    DataConfig,
    EvalConfig,
    LoggingConfig,
    ModelConfig,
    ParallelConfig,
    RolloutConfig,
    RunFailedError,
    SandboxConfig,
    TrainerConfig,
)

__all__ = [
    "MAX_CONFIG_BYTES", "MAX_YAML_DEPTH", "MAX_YAML_VALUES", "SEED_MAX",
    "AlgorithmConfig", "BackendSettings", "CheckpointConfig", "CheckpointError", "ClusterConfig", "Config", "ConfigError", "DataConfig", "EvalConfig",
    "LoggingConfig", "ModelConfig", "NoSettings", "ParallelConfig", "RenamedKeyWarning", "RolloutConfig", "RunFailedError", "SandboxConfig", "TrainerConfig",
    "check_config", "check_model", "load_config", "parse_overrides", "parse_yaml", "read_model_shape",
]
