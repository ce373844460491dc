"""The experiment config: one dataclass tree that YAML mirrors key for key (``rlsys.config.schema``).

``load_config`` reads a YAML file, applies ``key.path=value`` overrides, and checks every key, type and
field-level rule (``rlsys.config.rules``), raising ``ConfigError`` with the dotted path of the offending
key; the generic key and type checking is in ``rlsys.typed_yaml``. Rules that need the model
architecture (heads vs TP, layers vs PP, ...) and the cluster's fit live in ``rlsys.plan``.
"""

from __future__ import annotations

import copy
import typing
from typing import Any

import yaml

from rlsys import typed_yaml
from rlsys.config.resolve import releases_engine_memory, resolve
from rlsys.config.rules import check_fields
from rlsys.config.schema import (
    MOVED_KEYS,
    ROLES,
    TINY_HF_CONFIG,
    AdvantageConfig,
    AlgorithmConfig,
    AlgorithmName,
    BatchConfig,
    ClusterConfig,
    DataConfig,
    Dtype,
    DynamicSamplingConfig,
    FiltersConfig,
    FullyAsyncConfig,
    KLConfig,
    KLEstimator,
    LoggingConfig,
    LossAggMode,
    MismatchConfig,
    ModelConfig,
    MultiTurnConfig,
    OptimizerConfig,
    OverlongConfig,
    ParallelConfig,
    PolicyLossConfig,
    PolicyObjective,
    Recompute,
    RewardConfig,
    RoleConfig,
    RolloutConfig,
    RunConfig,
    SamplingConfig,
    ScheduleConfig,
    SGLangConfig,
    SyncConfig,
    TrainerConfig,
    ValueLossConfig,
    ValueObjective,
    response_tokens,
)

__all__ = [
    "AdvantageConfig",
    "AlgorithmConfig",
    "AlgorithmName",
    "BatchConfig",
    "ClusterConfig",
    "DataConfig",
    "Dtype",
    "DynamicSamplingConfig",
    "FiltersConfig",
    "FullyAsyncConfig",
    "KLConfig",
    "KLEstimator",
    "LoggingConfig",
    "LossAggMode",
    "MOVED_KEYS",
    "MismatchConfig",
    "ModelConfig",
    "MultiTurnConfig",
    "OptimizerConfig",
    "OverlongConfig",
    "ParallelConfig",
    "PolicyLossConfig",
    "PolicyObjective",
    "ROLES",
    "Recompute",
    "RewardConfig",
    "RoleConfig",
    "RolloutConfig",
    "RunConfig",
    "SamplingConfig",
    "ScheduleConfig",
    "SGLangConfig",
    "SyncConfig",
    "TINY_HF_CONFIG",
    "TrainerConfig",
    "ValueLossConfig",
    "ValueObjective",
    "releases_engine_memory",
    "response_tokens",
    "check_fields",
    "config_to_dict",
    "dump_yaml",
    "load_config",
]


def config_to_dict(cfg: Any) -> dict:
    """The plain-dict form of a config (or of any section), in field order."""
    return typed_yaml.to_dict(cfg)


def dump_yaml(cfg: RunConfig) -> str:
    """The resolved config as YAML; ``load_config`` of it gives back an equal config."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False)


def load_config(path: str | None, overrides: typing.Sequence[str] = ()) -> RunConfig:
    """Load, override and check a config; ``path=None`` starts from the defaults.

    Raises ``UserError`` for an unreadable or malformed file and ``ConfigError``
    (with the dotted key path) for unknown keys, wrong types and broken rules.
    """
    raw = typed_yaml.read_yaml_file(path) if path is not None else {}
    for override in overrides:
        typed_yaml.apply_override(raw, override, RunConfig, MOVED_KEYS)
    cfg = typed_yaml.merge(RunConfig(), raw, RunConfig, "", MOVED_KEYS)
    if cfg.model.path is None and cfg.model.hf_config is None:
        cfg.model.hf_config = copy.deepcopy(TINY_HF_CONFIG)
    check_fields(cfg)
    return resolve(cfg)  # every auto decided once (rlsys.config.resolve)
