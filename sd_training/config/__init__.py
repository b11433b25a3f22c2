"""The typed configuration, the ground floor: no module here imports another part of sd_training.

- ``fields``: ``f(default, help, choices=..., ranges)``, ``ConfigError``, ``ComponentConfig`` and the one
  check of what fields declare;
- ``schema``: the shared sections (``TrainConfig``), the dataset section in ``dataset``, and
  ``register_fields``: a part that owns more keys (``sd_training.families.options``: a family's second text
  encoder, the autoencoder stage, adapters) registers its dataclass, and ``train_config_class()`` is the
  schema with them;
- ``loading``: command line and YAML layers, ``~key`` removal, ``--help``, the dump (``to_yaml``);
- ``rules``: the schema-level rules that need several keys.

The checks that need an owner's code (the objective, the text encoders, the family, the data readers, the
memory plan) run from the layer that builds the run: ``sd_training.configure.load(argv)``.

Import a name from the module that owns it: ``from sd_training.config.schema import TrainConfig``,
``from sd_training.config.loading import parse``, ``from sd_training.configure import load``.
"""

from .fields import ComponentConfig, ConfigError, f

__all__ = ["ComponentConfig", "ConfigError", "f"]
