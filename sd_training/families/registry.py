"""The family registry: ``model.family`` -> the family class, detection from a pipeline's model_index.json,
and building the run's family. Adding a family is a module and one line in ``FAMILIES``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..adapters import check_export_kohya
from ..config import ConfigError
from ..config.schema import ModelConfig, TrainConfig
from ..outputs import sample_references
from .autoencoder import Autoencoder
from .base import Family
from .flux import Flux
from .flux_kontext import FluxKontext
from .flux2_dev import Flux2Dev
from .flux2_klein import Flux2Klein
from .qwen_image import QwenImage
from .qwen_image_edit import QwenImageEdit, QwenImageEditPlus
from .sd import StableDiffusion
from .sd3 import StableDiffusion3
from .sdxl import StableDiffusionXL
from .zimage import ZImage

# model.family -> the family; adding one is a module and a line here.
FAMILIES: dict[str, type[Family]] = {"sd": StableDiffusion, "sdxl": StableDiffusionXL, "sd3": StableDiffusion3, "flux": Flux,
                                     "flux_kontext": FluxKontext, "zimage": ZImage,
                                     "flux2_klein": Flux2Klein, "flux2_dev": Flux2Dev, "qwen_image": QwenImage,
                                     "qwen_image_edit": QwenImageEdit, "qwen_image_edit_plus": QwenImageEditPlus}
DEFAULT_FAMILY = "sd"  # the family of components set one by one (no pipeline root to read)


def _model_index(src: str, source_key: str = "model.pretrained", family_key: str = "model.family") -> dict | None:
    """The pipeline's model_index.json (a local folder, or a hub id in the local cache); None if there is
    none. A local one that is not a JSON object is a ``ConfigError`` naming the file."""
    path = os.path.join(src, "model_index.json")
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as fh:
                index = json.load(fh)
        except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise ConfigError(
                f"{path} (the model_index.json of {source_key}) cannot be read as JSON: {str(e).splitlines()[0]}. "
                f"Restore the file (e.g. download or copy the pipeline again), or set {family_key} to one of "
                f"{', '.join(FAMILIES)}") from None
        if not isinstance(index, dict):
            raise ConfigError(f"{path} (the model_index.json of {source_key}) holds a JSON {type(index).__name__}, "
                              "not an object naming the pipeline's class and components: restore the file")
        index["__path__"] = path
        return index
    if os.path.exists(src):
        return None  # a component folder or something else: not a pipeline root
    try:
        from diffusers import DiffusionPipeline

        return DiffusionPipeline.load_config(src)
    except Exception:
        return None


def detect(cfg: ModelConfig, must: bool = True) -> str | None:
    """The pipeline family's name: ``model.family``, else from the pipeline's model_index.json, else
    the default family when there is no pipeline root (components set one by one). ``must=False``: None
    when the pipeline cannot be read yet (the quickstart builds it at start-up)."""
    return detect_source(cfg.family, cfg.pretrained, must)


def detect_source(family: str, pretrained: str | None, must: bool = True, family_key: str = "model.family",
                  source_key: str = "model.pretrained") -> str | None:
    """:func:`detect` for a family name (``auto`` or a registry name) and a pipeline source given outside a
    config (a script's arguments: ``family_key`` and ``source_key`` name them in errors)."""
    if family != "auto":
        if family not in FAMILIES:
            raise ConfigError(f"'{family_key}' is '{family}', expected auto or one of {', '.join(FAMILIES)}")
        return family
    if not pretrained:
        return DEFAULT_FAMILY
    index = _model_index(pretrained, source_key, family_key)
    if index is None:
        if not must:
            return None
        raise ConfigError(f"'{family_key}=auto' cannot read the model_index.json of {source_key}={pretrained}: "
                          f"set {family_key} to one of {', '.join(FAMILIES)}")
    name = index.get("_class_name", "")
    if not name or not isinstance(name, str):
        where = index.get("__path__", f"the model_index.json of {source_key}={pretrained}")
        raise ConfigError(f"{where} has no '_class_name' (the pipeline class, e.g. StableDiffusionPipeline): the "
                          f"file is damaged or not a diffusers pipeline's. Restore it, or set {family_key} to one of "
                          f"{', '.join(FAMILIES)}")
    for family_name, cls in FAMILIES.items():
        if name in cls.pipeline_classes:
            return family_name
    raise ConfigError(f"{source_key}={pretrained} is a {name or 'pipeline without _class_name'}, which no "
                      f"family trains (known: {', '.join(c for f in FAMILIES.values() for c in f.pipeline_classes)}); "
                      f"set {family_key} if it is one of them under another name")


def validate(cfg: TrainConfig) -> None:
    """The family's config checks, when the family is known before start-up (else at start-up)."""
    if cfg.model.train_target == "vae":
        Autoencoder.validate(cfg)
    name = detect(cfg.model, must=False)
    if name is not None:
        FAMILIES[name].validate(cfg)
        check_export_kohya(cfg, FAMILIES[name])
        sample_references.check(cfg, FAMILIES[name])


def create(cfg: TrainConfig, device: torch.device, seed: int, is_main: bool) -> Family:
    """Build the run's family (its components included); checks the config against it first."""
    name = detect(cfg.model)
    pipeline_family = FAMILIES[name]
    pipeline_family.validate(cfg)
    check_export_kohya(cfg, pipeline_family)
    sample_references.check(cfg, pipeline_family)
    if cfg.model.train_target == "vae":
        Autoencoder.validate(cfg)
        return Autoencoder(cfg, device, seed, is_main, pipeline_family)
    return pipeline_family(cfg, device, seed, is_main)


def make_tiny_pipeline(out_dir: str | os.PathLike, seed: int = 0, scaling_factor: float | None = None,
                       family: str | None = None) -> Path:
    """Save a random-weight pipeline of ``family`` (a name in the registry; None: the default family's) to
    ``out_dir`` and return the path. The weights come from torch's RNG seeded with ``seed``; the caller's
    RNG stream is left as it was."""
    family = DEFAULT_FAMILY if family is None else family
    if family not in FAMILIES:
        raise ValueError(f"family {family!r}: expected one of {', '.join(FAMILIES)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return FAMILIES[family].make_tiny_pipeline(Path(out_dir), scaling_factor)


# memory and FLOP estimates ---------------------------------------------------------------------
def trained_family(cfg: TrainConfig) -> type[Family] | None:
    """The family class whose module ``cfg`` trains, told from the config alone (the autoencoder under
    ``model.train_target=vae``); None when the pipeline cannot be read yet (``detect(must=False)``)."""
    if cfg.model.train_target == "vae":
        return Autoencoder
    try:
        name = detect(cfg.model, must=False)
    except ConfigError:  # a pipeline the config checks report
        return None
    return FAMILIES.get(name or "")
