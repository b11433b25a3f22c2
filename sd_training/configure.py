"""The whole config check, in one place above the owners.

``config.parse`` reads the YAML and the command line into the schema and checks what the schema owns
(types, choices, ranges, keys that only make sense together). Every section's owner checks the rest:
the data package its ``dataset`` section, the objective its loss, the text-encoder module its
encoder, the model family its components. ``load`` runs them all; the training entry point, scripts
and tests call it.
"""

from __future__ import annotations

from . import families
from .config import TrainConfig, parse
from .data import validate_dataset_config
from .fields import ConfigError
from .models import check_unet_params
from .objective import validate_objective_config
from .text_encoders import validate_text_encoder_config
from .vae_objective import VAEObjectiveConfig


def check(cfg: TrainConfig) -> TrainConfig:
    """Run every owner's checks on a parsed config; raises ``ConfigError`` naming the key."""
    validate_objective_config(cfg.objective)
    validate_text_encoder_config(cfg.model.text_encoder)
    if cfg.model.unet.params:
        check_unet_params(cfg.model.unet.target, cfg.model.unet.params)
    if cfg.model.train_target != "vae" and cfg.vae_training != VAEObjectiveConfig():
        raise ConfigError("the 'vae_training' section applies to model.train_target=vae only")
    families.validate(cfg)
    validate_dataset_config(cfg.dataset)
    return cfg


def load(argv: list[str] | None = None, *, yaml_text: str | None = None) -> TrainConfig:
    """The resolved, fully checked ``TrainConfig`` from the command line (and/or YAML text)."""
    return check(parse(argv, yaml_text=yaml_text))
