"""The run's configuration: frozen dataclasses per section, loading a config file, `--set` overrides,
validation, and the project's errors. `from jaxrl.config import Config, ConfigError` is the usual import."""

from jaxrl.config.agent import AgentConfig
from jaxrl.config.critic import CriticConfig
from jaxrl.config.distill import DistillConfig
from jaxrl.config.errors import CheckpointError, ConfigError, NonFiniteError, RunError
from jaxrl.config.load import apply_overrides, check_types, load_file, override, to_dict
from jaxrl.config.lora import LoraConfig
from jaxrl.config.model import ModelConfig
from jaxrl.config.reward_model import RewardModelConfig
from jaxrl.config.rollout import EngineConfig, RolloutConfig, RolloutMeshConfig, SpeculativeConfig
from jaxrl.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    LogConfig,
    LossConfig,
    MeshConfig,
    OptimConfig,
    WarmStartConfig,
    load_config,
    parse_loss_options,
)
from jaxrl.config.train import REMAT, TrainConfig

__all__ = [
    "REMAT",
    "AgentConfig",
    "CheckpointConfig",
    "CheckpointError",
    "Config",
    "ConfigError",
    "CriticConfig",
    "DataConfig",
    "DistillConfig",
    "EngineConfig",
    "LogConfig",
    "LoraConfig",
    "LossConfig",
    "MeshConfig",
    "ModelConfig",
    "NonFiniteError",
    "OptimConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "RolloutMeshConfig",
    "RunError",
    "SpeculativeConfig",
    "TrainConfig",
    "WarmStartConfig",
    "apply_overrides",
    "check_types",
    "load_config",
    "load_file",
    "override",
    "parse_loss_options",
    "to_dict",
]
