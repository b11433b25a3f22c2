"""The whole config check: the schema's rules (``loading.parse``), then every section owner's checks.

The owners check what needs their code: the objective its loss, the text-encoder module its encoder,
the models module the UNet's constructor arguments, the model family its components, the data package
what needs its readers (filters parse, ``idx_to_prompt`` loads). ``load`` is what the training entry
point, scripts and tests call. Unlike the rest of the package, this module imports torch (through the
owners).
"""

from __future__ import annotations

from ..data.checks import check_dataset_inputs
from ..families import options, registry
from ..families.unet_components import check_unet_params
from ..objective import validate_objective_config
from ..text_encoders import validate_text_encoder_config
from .loading import parse
from .schema import TrainConfig


def check(cfg: TrainConfig) -> TrainConfig:
    """Run every owner's checks on a parsed config; raises ``ConfigError`` naming the key."""
    validate_objective_config(cfg.objective)
    validate_text_encoder_config(cfg.model.text_encoder)
    if cfg.model.unet.params:
        check_unet_params(cfg.model.unet.target, cfg.model.unet.params)
    options.check(cfg)
    registry.validate(cfg)
    check_dataset_inputs(cfg.dataset)
    return cfg


def load(argv: list[str] | None = None, *, yaml_text: str | None = None) -> TrainConfig:
    """The resolved, fully checked ``TrainConfig`` from the command line (and/or YAML text)."""
    return check(parse(argv, yaml_text=yaml_text))
