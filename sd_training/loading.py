"""Loading a diffusers/transformers component from a pipeline root, a component folder or a hub id."""

from __future__ import annotations

import difflib
import inspect
import os

from .config import ConfigError


def load_component(loader, src: str, subfolder: str, what: str, **kwargs):
    """``loader(src)`` on a pipeline root (through ``subfolder``), a component folder, or a hub id.

    ``what`` names the config key in errors; a missing local folder or an unreachable hub id is a
    ``ConfigError`` that says what to do.
    """
    if os.path.isdir(src):
        args = dict(subfolder=subfolder) if os.path.isdir(os.path.join(src, subfolder)) else {}
    elif os.path.exists(src) or src.startswith((".", "/", "~")):
        raise ConfigError(f"'{what}': '{src}' is not a directory (expected a diffusers pipeline or component folder)")
    else:  # a hub id: the component lives in its subfolder
        args = dict(subfolder=subfolder)
    try:
        return loader(src, **args, **kwargs)
    except OSError as e:
        raise ConfigError(
            f"cannot load '{what}' from '{src}'{'/' + args['subfolder'] if args else ''}: {str(e).splitlines()[0]} "
            "(for a hub id without network, download it first: python scripts/download_diffusers.py -o DIR -m ID)"
        ) from None


def check_constructor_params(cls, params: dict, key: str) -> None:
    """Refuse constructor arguments (``key``: their config path, e.g. ``model.unet.params``) that ``cls``
    does not take, naming the closest one: a typo is a config error, not a silently dropped key."""
    valid = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    for name in params:
        if name not in valid:
            close = difflib.get_close_matches(name, valid, n=1)
            hint = f"; did you mean '{key}.{close[0]}'?" if close else ""
            raise ConfigError(f"unknown config key '{key}.{name}' ({cls.__name__} has no such argument){hint}")
