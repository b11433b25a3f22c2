"""The typed configuration, one package:

- ``fields``: ``f(default, help, choices=..., ranges)``, ``ConfigError``, ``ComponentConfig`` and the one
  check of what fields declare;
- ``schema``: every section (``TrainConfig``), the dataset section in ``dataset`` with its rules, a
  family's own sections from ``sd_training.families.options``;
- ``loading``: command line and YAML layers, ``~key`` removal, ``--help``, the dump (``to_yaml``);
- ``rules``: the schema-level rules that need several keys;
- ``checks``: ``load(argv)``, the schema's rules then every owner's checks (imports torch through them).

Import a name from the module that owns it: ``from sd_training.config.schema import TrainConfig``,
``from sd_training.config.loading import parse``, ``from sd_training.configure import load``. The
package itself holds only what every section's module needs (``f``, ``ConfigError``,
``ComponentConfig``), so a family's own sections (``sd_training.families.options``) can import them while
the schema imports those sections. Nothing here but ``checks`` imports torch or model, objective or data
code.
"""

from .fields import ComponentConfig, ConfigError, f

__all__ = ["ComponentConfig", "ConfigError", "f"]
