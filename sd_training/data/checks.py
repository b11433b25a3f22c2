"""Checks of the ``dataset`` section that need the data code (filters parse, ``idx_to_prompt`` loads).

The section's schema rules (types, keys per ``dataset.type``, choices, ranges, the mixture's entries)
are ``sd_training.config.dataset.check_dataset``, run when a config loads; ``validate_dataset_config``
runs both, for a ``DatasetConfig`` built without the config loader (scripts, tests)."""

from __future__ import annotations

from ..config.dataset import DatasetConfig, check_dataset, plain_config, plain_value
from .captions import load_idx_to_prompt
from .filters import parse_filters


def check_dataset_inputs(cfg: DatasetConfig) -> None:
    """What only the data code can check: every filter expression parses (never ``eval``), the mixture's
    per-source filters too, and ``idx_to_prompt`` loads. Raises ``DatasetConfigError`` naming the key."""
    p = plain_config(cfg).params
    parse_filters(plain_value(p.filters))  # raises naming the key
    for entry in p.sources or []:
        if "filters" in entry:
            parse_filters(dict(entry["filters"] or {}))
    if plain_value(p.idx_to_prompt) is not None:
        load_idx_to_prompt(plain_value(p.idx_to_prompt))


def validate_dataset_config(cfg: DatasetConfig) -> None:
    """Reject settings that cannot work, before anything is built: the schema's rules, then the data
    checks. Raises :class:`DatasetConfigError` naming the key."""
    check_dataset_inputs(check_dataset(cfg))
