"""The typed configuration, one package:

- ``fields``: ``f(default, help, choices=..., ranges)``, ``ConfigError``, ``ComponentConfig`` and the one
  check of what fields declare;
- ``schema``: every section (``TrainConfig``), the dataset section in ``dataset`` with its rules, a
  family's own sections from ``sd_training.families.options``;
- ``loading``: command line and YAML layers, ``~key`` removal, ``--help``, the dump (``to_yaml``);
- ``rules``: the schema-level rules that need several keys;
- ``checks``: ``load(argv)``, the schema's rules then every owner's checks (imports torch through them).

``import sd_training.config`` imports no torch and no model, objective or data code. Names of the schema
and of ``loading`` are re-exported here (``from sd_training.config import TrainConfig, parse``); they are
imported on first use, so that a family's options module can import ``sd_training.config.fields`` while
the schema imports it.
"""

from __future__ import annotations

import importlib

from .fields import ComponentConfig, ConfigError, f

_EXPORTS = {
    "schema": ("TrainConfig", "ModelConfig", "WandbConfig", "SystemConfig", "DistributedConfig", "ExperimentConfig",
               "OptimizerConfig", "OptimizerParams", "LRSchedulerConfig", "LRSchedulerParams", "VAEConfig",
               "UNetConfig", "EMAConfig", "QuickstartConfig", "ValidationConfig", "EvaluationConfig",
               "ObjectiveConfig", "TextEncoderConfig", "PRECISIONS", "WEIGHT_DTYPES", "SCHEDULERS", "schema_entries"),
    "dataset": ("DatasetConfig", "DatasetParams", "TagParams", "DatasetConfigError", "is_latent_type"),
    "loading": ("ASSETS", "REDACTED", "parse", "parse_argv", "resolve", "help_text", "public_dict", "to_yaml"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = ["ComponentConfig", "ConfigError", "f", *_WHERE]


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
